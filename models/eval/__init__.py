"""Evaluation: the long-context evaluator (`long_context`: needles at chosen depths,
accuracy by length and depth; the main job's readers and the needle demo's grid) and
lm-evaluation-harness's model (`harness`)."""
