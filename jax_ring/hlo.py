"""What a compiled program sends between devices, read from its HLO text.

`collective_bytes(compiled)` adds up the result bytes of every collective op per
device, with each op inside a while loop counted once per iteration (XLA records the
trip counts of the loops it can bound, as `known_trip_count`, which covers every
`lax.scan`). A conditional counts its most expensive branch. The result buffer of a
collective-permute is what each device sends (and receives); an all-to-all's result is
the device's whole rearranged array, of which (u - 1) / u came from the u - 1 other
devices of its group.

Used by the tests (the hybrid moves only all-to-all and collective-permute bytes, as
many as the formula in the README says) and by the benchmarks, for the bytes each
device moves beside each timing.
"""

from __future__ import annotations

import functools
import re

COLLECTIVES = (
  "all-to-all",
  "collective-permute",
  "all-gather",
  "all-reduce",
  "reduce-scatter",
  "collective-broadcast",
)

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4}
_BYTES.update({"s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16})
_SHAPE = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([0-9,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(")
_OP = re.compile(r"= (.*?) (" + "|".join(COLLECTIVES) + r")(-start)?\(")
_WHILE = re.compile(r"\bwhile\(.*\bbody=%?([\w.\-]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_BRANCHES = re.compile(
  r"branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+), false_computation=%?([\w.\-]+)"
)
_CALLS = re.compile(r"\b(?:calls|to_apply)=%?([\w.\-]+)")


def shape_bytes(text: str) -> int:
  """Bytes of the array shapes written in `text` (e.g. "(f32[2,8], s32[8])")."""
  total = 0
  for dtype, dims in _SHAPE.findall(text):
    size = 1
    for d in filter(None, dims.split(",")):
      size *= int(d)
    total += size * _BYTES[dtype]
  return total


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
  """name -> instruction lines, and the entry computation's name."""
  comps, entry, name = {}, None, None
  for line in hlo.splitlines():
    if name is None:
      m = _HEADER.match(line)
      if m and line.rstrip().endswith("{"):
        name = m.group(1)
        comps[name] = []
        if line.startswith("ENTRY"):
          entry = name
    elif line.strip() == "}":
      name = None
    else:
      comps[name].append(line)
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  return comps, entry


def collective_bytes(compiled) -> dict[str, int]:
  """op name ("all-to-all", "collective-permute", ...) -> bytes of its results per
  device over one run of the program; ops that do not occur are absent.

  `compiled`: a `jax.stages.Compiled` or its `as_text()`. Raises ValueError for a
  loop with collectives whose trip count XLA did not record."""
  hlo = compiled if isinstance(compiled, str) else compiled.as_text()
  comps, entry = _computations(hlo)

  @functools.cache
  def cost(name: str) -> tuple[tuple[str, int], ...]:
    found: dict[str, int] = {}

    def add(part, times=1):
      for op, n in part:
        found[op] = found.get(op, 0) + n * times

    for line in comps.get(name, ()):
      if m := _OP.search(line):
        found[m.group(2)] = found.get(m.group(2), 0) + shape_bytes(m.group(1))
      elif m := _WHILE.search(line):
        body = cost(m.group(1))
        trips = _TRIPS.search(line)
        if body and trips is None:
          raise ValueError(f"a while loop with collectives has no known trip count: {line.strip()[:200]}")
        add(body, int(trips.group(1)) if trips else 0)
      elif m := _BRANCHES.search(line):
        names = m.group(1).split(",") if m.group(1) else [m.group(2), m.group(3)]
        branches = [dict(cost(n.strip().lstrip("%"))) for n in names]
        add(max((tuple(b.items()) for b in branches), key=lambda b: sum(n for _, n in b)))
      else:
        for called in _CALLS.findall(line):
          add(cost(called))
    return tuple(found.items())

  return dict(cost(entry))
