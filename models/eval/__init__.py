"""Evaluation: long documents with needles read over the ring (`long_context`, the main
job), the trained models' needle grid (`needle`), and lm-evaluation-harness's model
(`harness`)."""
