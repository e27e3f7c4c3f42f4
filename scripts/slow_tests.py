"""Writes tests/slow.txt, the tests `-m "not slow"` leaves out, from pytest's timings.

    bash scripts/run_tests.sh --durations=0 | tee /tmp/durations.txt
    python scripts/slow_tests.py /tmp/durations.txt [--seconds 1.5]

A test is slow when its set-up and call took `--seconds` or more together (on the
2-core CI machine, two pytest-xdist workers); tests/conftest.py marks the listed ones
`slow`. The rest then run in under 5 minutes (docs/development.md, "Tests").
"""

from __future__ import annotations

import collections
import pathlib
import re

from jax_ring.models import cli

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "slow.txt"

LINE = re.compile(r"\s*([\d.]+)s\s+(setup|call|teardown)\s+(.+?)\s*$")  # an id may hold spaces
HEADER = """\
# Tests marked slow by tests/conftest.py: each took {seconds} s or more (set-up and call)
# in a run of the whole suite on 2 cores. Made by scripts/slow_tests.py from that run's
# --durations=0 output; one pytest node id a line, with its seconds.
"""


def parse_args(argv=None):
  parser = cli.parser(__doc__)
  parser.add_argument("durations", help="pytest's output with --durations=0")
  parser.add_argument("--seconds", type=float, default=1.5, help="a test this slow or slower is slow")
  parser.add_argument("--out", default=str(OUT), help="the list to write")
  return parser.parse_args(argv)


def main(argv=None) -> None:
  args = parse_args(argv)
  spent = collections.defaultdict(float)
  for line in pathlib.Path(args.durations).read_text().splitlines():
    match = LINE.match(line)
    if match and match.group(2) != "teardown":
      # "id@group": the name pytest-xdist's --dist loadgroup gives a grouped test
      spent[re.sub(r"@[\w-]+$", "", match.group(3))] += float(match.group(1))
  if not spent:
    raise SystemExit(f"{args.durations}: no pytest durations in it (run pytest with --durations=0)")
  slow = sorted((t, s) for t, s in spent.items() if s >= args.seconds)
  lines = [f"{test}  {s:.1f}" for test, s in slow]
  pathlib.Path(args.out).write_text(HEADER.format(seconds=args.seconds) + "\n".join(lines) + "\n")
  rest = sum(s for s in spent.values() if s < args.seconds)
  total = sum(s for _, s in slow)
  print(f"{len(slow)} of {len(spent)} timed tests slow ({total:.0f} s); the rest {rest:.0f} s")


if __name__ == "__main__":
  main()
