r"""A small verifiable task for reinforcement learning from rewards: sums of two numbers
asked in a few-shot pattern a base model continues, and rewards that parse the answer
(TRL's reward-function signature, for `scripts/finetune.py --objective grpo --reward
scripts/bench/arithmetic.py:correct`).

    python scripts/bench/arithmetic.py --write prompts.jsonl [--count 256] [--most 10] [--seed 0]
    python scripts/finetune.py MODEL --data prompts.jsonl --objective grpo \
        --reward scripts/bench/arithmetic.py:correct --reward scripts/bench/arithmetic.py:close \
        --num-generations 4 --max-completion-length 256 --devices 8 --out run

Each record holds "prompt" and "answer" (the sum, a string): the reward functions read
the answer column by its name.
"""

from __future__ import annotations

import json
import re

SHOTS = "Q: 3 + 4 = ?\nA: 7\nQ: 12 + 5 = ?\nA: 17\nQ: 20 + 31 = ?\nA: 51\n"
FIRST = re.compile(r"\s*(-?\d+)")


def records(count: int, seed: int = 0, most: int = 10) -> list[dict]:
  """`count` prompts "Q: a + b = ?\\nA:" after three solved ones, a and b in [0, most)."""
  import numpy as np

  rng = np.random.default_rng(seed)
  out = []
  for a, b in rng.integers(0, most, (count, 2)).tolist():
    out.append({"prompt": f"{SHOTS}Q: {a} + {b} = ?\nA:", "answer": str(a + b)})
  return out


def _text(completion) -> str:
  return completion if isinstance(completion, str) else completion[0]["content"]


def correct(prompts, completions, answer, **kw) -> list[float]:
  """1 where the completion starts with the right number, else 0."""
  out = []
  for c, a in zip(completions, answer):
    found = FIRST.match(_text(c))
    out.append(1.0 if found and found.group(1) == a else 0.0)
  return out


def close(prompts, completions, answer, **kw) -> list[float]:
  """max(0, 1 - |first number - the sum| / 10): how near the completion's first number
  is (0 where it starts with none)."""
  out = []
  for c, a in zip(completions, answer):
    found = FIRST.match(_text(c))
    out.append(max(0.0, 1.0 - abs(int(found.group(1)) - int(a)) / 10) if found else 0.0)
  return out


def number_first(prompts, completions, **kw) -> list[float]:
  """0.2 where the completion starts with a number at all (the pattern's form)."""
  return [0.2 if FIRST.match(_text(c)) else 0.0 for c in completions]


def parse_args(argv=None):
  from jax_ring.models import cli

  p = cli.parser(__doc__)
  p.add_argument("--write", default="prompts.jsonl", help="the prompts' .jsonl file")
  p.add_argument("--count", type=int, default=256, help="prompts to write")
  p.add_argument("--most", type=int, default=10, help="the numbers added lie in [0, most)")
  p.add_argument("--seed", type=int, default=0, help="the numbers' seed")
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  with open(args.write, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in records(args.count, args.seed, args.most))
  print(f"wrote {args.count} prompts to {args.write}")


if __name__ == "__main__":
  main()
