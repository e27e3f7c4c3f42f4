"""What a compiled program sends between devices, read from its HLO text.

`ring_overlap(compiled)` reads, for every loop body that sends with collective-permute
(each ring step), how much of its compute runs while a transfer is in flight.

`collective_bytes(compiled)` adds up the bytes of every collective op per device (an
all-gather's gathered results, a reduce-scatter's operands, any other's results), with
each op inside a while loop counted once per iteration (`trip_count`: XLA records
`known_trip_count` on CPU and GPU; on TPU it is read from the loop's condition).
A conditional counts its most expensive branch. The result buffer of a
collective-permute is what each device sends (and receives); an all-to-all's result is
the device's whole rearranged array, of which (u - 1) / u came from the u - 1 other
devices of its group.

`loop_free_collectives(compiled)` lists the collectives outside every loop: what a
program moves besides its ring steps (a model that relays its tokens for each layer's
attention shows it there). `loop_free_copies(compiled)` lists the copies and
transposes outside every loop: an array held twice in two layouts shows there.

Used by the tests (the hybrid moves only all-to-all and collective-permute bytes, as
many as the formula in the README says) and by the benchmarks, for the bytes each
device moves beside each timing.
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

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
_COND = re.compile(r"\bcondition=%?([\w.\-]+)")
_INIT = re.compile(r"\bwhile\(%([\w.\-]+)\)")
_CONST = re.compile(r"\s*%([\w.\-]+) = s(?:32|64)\[\][^ ]* constant\((-?\d+)\)")
_INSTR = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = .*? ([a-z][a-z0-9\-]*)\(")


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


def _instruction(line: str) -> tuple[str, str] | None:
  """(name, opcode) of one HLO instruction line, or None."""
  m = _INSTR.match(line)
  return (m.group(1), m.group(2)) if m else None


def trip_count(line: str, comps: dict[str, list[str]]) -> int | None:
  """Iterations of the while loop on `line`: XLA's `known_trip_count` where it recorded
  one (CPU, GPU), else read from the loop's condition (TPU records none): an induction
  variable compared "LT" with a bound, counting from the constant it starts at
  (`lax.scan` and `fori_loop` with static bounds count from 0 by 1). The bound is a
  constant in the condition, or one the loop carries unchanged from its initial tuple,
  traced back through copies, tuples, optimization barriers and enclosing loops that
  carry it unchanged too: a ring pass of one step keeps its loop by passing its trip
  count through an optimization barrier (`_ring._steps`), which XLA removes only after
  it has looked for trip counts. GPU programs wrap the compare in a fusion."""
  if trips := _TRIPS.search(line):
    return int(trips.group(1))
  cond = _COND.search(line)
  if cond is None:
    return None
  cond_lines = comps.get(cond.group(1), ())
  compared = _compared(cond_lines, comps)
  if compared is None:
    return None
  graph = _Dataflow(comps)
  bound = graph.constant(cond.group(1), compared[1])
  if bound is None:
    return None
  return bound - (graph.initial(cond.group(1), compared[0]) or 0)


def _compared(cond_lines: list[str], comps) -> tuple[str, str] | None:
  """The operands (names in the condition) of its "LT" compare, itself or in the fusion
  the condition's root calls."""
  for body_line in cond_lines:
    if "compare(" in body_line and "direction=LT" in body_line:
      operands = re.findall(r"%([\w.\-]+)", body_line.split("compare(", 1)[1].split(")", 1)[0])
      return (operands[0], operands[1]) if len(operands) == 2 else None
  for body_line in cond_lines:
    if " fusion(" not in body_line or not (called := _CALLS.search(body_line)):
      continue
    inner = comps.get(called.group(1), ())
    found = _compared(inner, comps)
    if found is None:
      continue
    args = _operand_list(body_line, "fusion")
    params = {}
    for inner_line in inner:
      if m := re.match(r"\s*%([\w.\-]+) = \S+ parameter\((\d+)\)", inner_line):
        params[m.group(1)] = int(m.group(2))
    if all(name in params and params[name] < len(args) for name in found):
      return args[params[found[0]]], args[params[found[1]]]
  return None


def _operand_list(line: str, opcode: str) -> list[str]:
  return re.findall(r"%([\w.\-]+)", line.split(f" {opcode}(", 1)[1].split(")", 1)[0])


class _Dataflow:
  """Where an integer scalar of a computation comes from, for `trip_count`: a constant
  reached through copies, tuple elements, optimization barriers, and a loop's state
  where the loop carries that element unchanged (the loop starts with it and every
  iteration passes it on)."""

  def __init__(self, comps: dict[str, list[str]]):
    self.comps = comps
    self.defs = {}  # (computation, name) -> line
    self.loops = {}  # body or condition computation -> (caller computation, while line, body)
    for comp, lines in comps.items():
      for line in lines:
        if ins := _instruction(line):
          self.defs[(comp, ins[0])] = line
        if ins and ins[1] == "while" and (body := _WHILE.search(line)) and (cond := _COND.search(line)):
          for called in (body.group(1), cond.group(1)):
            self.loops[called] = (comp, line, body.group(1))

  def initial(self, cond: str, name: str) -> int | None:
    """The constant that element `name` (a get-tuple-element of the state) of the loop
    whose condition is `cond` starts at, changed by the loop or not."""
    line = self.defs.get((cond, name), "")
    if " get-tuple-element(" not in line or cond not in self.loops:
      return None
    index = int(re.search(r"index=(\d+)", line).group(1))
    caller, while_line, _ = self.loops[cond]
    init = _INIT.search(while_line)
    return None if init is None else self.element(caller, init.group(1), index, 1)

  def constant(self, comp: str, name: str, depth: int = 0) -> int | None:
    line = self.defs.get((comp, name))
    if line is None or depth > 32:
      return None
    if m := _CONST.match(line):
      return int(m.group(2))
    ins = _instruction(line)
    if ins is None:
      return None
    opcode = ins[1]
    if opcode in ("copy", "opt-barrier", "bitcast"):
      return self.constant(comp, _operand_list(line, opcode)[0], depth + 1)
    if opcode != "get-tuple-element":
      return None
    index = int(re.search(r"index=(\d+)", line).group(1))
    source = _operand_list(line, opcode)[0]
    return self.element(comp, source, index, depth + 1)

  def element(self, comp: str, name: str, index: int, depth: int) -> int | None:
    """The constant at `index` of the tuple `name` of `comp`."""
    line = self.defs.get((comp, name))
    if line is None or depth > 32:
      return None
    opcode = _instruction(line)[1]
    if opcode == "tuple":
      operands = _operand_list(line, "tuple")
      return self.constant(comp, operands[index], depth + 1) if index < len(operands) else None
    if opcode in ("opt-barrier", "copy"):
      return self.element(comp, _operand_list(line, opcode)[0], index, depth + 1)
    if opcode == "parameter" and comp in self.loops:
      caller, while_line, body = self.loops[comp]
      if not self._passed_on(body, index):
        return None
      init = _INIT.search(while_line)
      return None if init is None else self.element(caller, init.group(1), index, depth + 1)
    return None

  def _passed_on(self, body: str, index: int) -> bool:
    """Whether every iteration of the loop `body` hands element `index` of its state on
    as it got it."""
    lines = self.comps.get(body, ())
    root = next((line for line in lines if line.lstrip().startswith("ROOT ")), None)
    if root is None or " tuple(" not in root:
      return False
    operands = _operand_list(root, "tuple")
    if index >= len(operands):
      return False
    name = operands[index]
    for _ in range(8):
      line = self.defs.get((body, name), "")
      ins = _instruction(line)
      if ins is None:
        return False
      if ins[1] == "copy":
        name = _operand_list(line, "copy")[0]
        continue
      if ins[1] == "get-tuple-element" and f"index={index}" in line:
        source = self.defs.get((body, _operand_list(line, "get-tuple-element")[0]), "")
        return " parameter(" in source
      return False
    return False


class LoopOverlap(NamedTuple):
  """One loop body with collective-permutes (a ring step), from `ring_overlap`.

  Two questions, both per step: is every op of compute under some transfer (`hidden`
  of `compute`), and does every transfer have compute under it (`exposed_bytes`)? A
  transfer is exposed when XLA runs it synchronously (a plain collective-permute, or a
  start whose backend config says "is_sync":true: XLA's GPU pipeline turns an async
  pair with nothing to overlap into one on the compute stream) or when no compute op
  lies between its start and its done."""

  body: str  # the body computation's name
  starts: int  # collective-permute-starts (start/done pairs), "is_sync" ones included
  synchronous: int  # transfers that block: plain collective-permutes and "is_sync":true starts
  compute: int  # heavy ops in the body: loops, conditionals, kernel calls, GEMM fusions
  hidden: int  # of those, the ones between the start and the done of some transfer
  name: str = ""  # what the loop is, from its ops' source names (`loop_name`)
  hidden_bytes: int = 0  # bytes a device sends per step in transfers with compute under them
  exposed_bytes: int = 0  # bytes per step in synchronous transfers or ones with nothing under them
  exposed: int = 0  # how many transfers are exposed

  @property
  def overlapped(self) -> bool:
    """All the step's compute under a transfer, and every transfer asynchronous with
    compute under it."""
    return self.starts > 0 and self.hidden == self.compute and self.exposed == 0


# Custom calls that only place or reinterpret buffers (XLA's TPU backend allocates a
# loop's carried buffers with AllocateBuffer and joins slices with ConcatBitcast):
# no compute to hide a transfer under.
_BUFFER_CALLS = (
  "AllocateBuffer",
  "ConcatBitcast",
  "SliceToDynamic",
  "PadToStatic",
  "MoveToHost",
  "MoveToDevice",
)
_TARGET = re.compile(r'custom_call_target="([^"]+)"')


def _heavy(opcode: str, line: str, comps) -> bool:
  """Whether an instruction is compute worth hiding a transfer under."""
  if opcode == "custom-call":
    target = _TARGET.search(line)
    return not (target and target.group(1) in _BUFFER_CALLS)
  if opcode in ("while", "conditional", "call", "dot", "convolution"):
    return True
  if opcode == "fusion":
    called = _CALLS.findall(line)
    return any(
      re.search(r" (dot|convolution|custom-call)\(", body) for name in called for body in comps.get(name, ())
    )
  return False


def ring_overlap(compiled) -> list[LoopOverlap]:
  """Per loop body that sends with collective-permute (each ring step of a compiled
  program, forward and backward), how much of its compute runs while a transfer is in
  flight: the instructions of a scheduled module are listed in their execution order,
  so an op lies under a transfer when it comes after the transfer's start and before
  its done (`_walk`). `compiled`: a `jax.stages.Compiled` or its `as_text()`."""
  hlo = compiled if isinstance(compiled, str) else compiled.as_text()
  comps, _ = _computations(hlo)
  callers = _while_callers(comps)
  found = []
  for body in sorted(callers):
    lines = comps.get(body, ())
    ops = [ins[1] for line in lines if (ins := _instruction(line))]
    starts, plain = ops.count("collective-permute-start"), ops.count("collective-permute")
    if not starts and not plain:
      continue
    transfers, compute, hidden = _walk(comps, lines, "collective-permute")
    exposed = [t for t in transfers if t[3] or t[4] == 0]
    found.append(
      LoopOverlap(
        body,
        starts,
        plain + sum(_IS_SYNC in line for line in lines),
        compute,
        hidden,
        loop_name(lines, callers[body]),
        sum(t[1] for t in transfers) - sum(t[1] for t in exposed),
        sum(t[1] for t in exposed),
        len(exposed),
      )
    )
  return found


# XLA:TPU's async collective fusions: a collective run in steps, each fused with
# compute, from a fusion named async-collective-start[.N] to async-collective-done[.N];
# every one of them calls a computation holding the collective.
_TPU_ASYNC = re.compile(r"async-collective-(start|done)(\.\d+)?")


def _fused_collective(comps, line: str, shapes=None) -> tuple[str, int, str] | None:
  """(op, bytes, source) of the collective in the computation a fusion calls, or None."""
  for called in _CALLS.findall(line):
    for inner in comps.get(called, ()):
      if m := _OP.search(inner):
        source = n.group(1) if (n := _OP_NAME.search(inner)) else ""
        return m.group(2), _result_bytes(inner, shapes), source
  return None


def _fusion_bodies(comps) -> set[str]:
  """The computations fusions call: their instructions run inside the fusion (a TPU
  async collective's steps, `_TPU_ASYNC`), not as ops of their own."""
  return {
    called
    for lines in comps.values()
    for line in lines
    if (ins := _instruction(line)) and ins[1] == "fusion"
    for called in _CALLS.findall(line)
  }


def _walk(comps, lines, kinds: str, rename=None, shapes=None) -> tuple[list[list], int, int]:
  """(transfers, compute, hidden) of one scheduled computation: each collective whose
  op name matches `kinds` (a regex) as [op, bytes (`_result_bytes`), source, blocks,
  compute ops under it], in the order they end; `compute`, the heavy ops (`_heavy`);
  `hidden`, those under some transfer. A collective blocks when it is a plain one or
  an "is_sync" start. A nested loop that sends (a ring loop, reported as a body of its
  own) is not this computation's compute, but a transfer in flight across it runs
  under that loop's compute. A done whose start lies in an earlier iteration (XLA's
  pipeliner) counts the compute before it in this one; a start whose done lies in the
  next, the compute after it. `rename(source)`: the source as reported; `shapes`:
  `_shapes(comps)`, for a synchronous reduce-scatter's operands."""
  open_: dict[str, list] = {}
  transfers: list[list] = []
  compute = hidden = 0
  for line in lines:
    ins = _instruction(line)
    if ins is None:
      continue
    name, opcode = ins
    base = re.fullmatch(rf"({kinds})(-start|-done)?", opcode)
    tpu = _TPU_ASYNC.fullmatch(name) if opcode == "fusion" else None
    found = _fused_collective(comps, line, shapes) if tpu else None
    if found and re.fullmatch(kinds, found[0]):
      op, size, source = found
      source = rename(source) if rename else source
      key = "async-collective" + (tpu.group(2) or "")
      if tpu.group(1) == "start":
        open_[key] = [op, size, source, False, 0]
      else:
        transfers.append(open_.pop(key, None) or [op, size, source, False, compute])
    elif base:
      source = m.group(1) if (m := _OP_NAME.search(line)) else ""
      source = rename(source) if rename else source
      op, phase = base.groups()
      if phase == "-start":
        open_[name] = [op, _result_bytes(line, shapes), source, _IS_SYNC in line, 0]
      elif phase == "-done":
        transfers.append(
          open_.pop(_operand(line), None) or [op, _result_bytes(line, shapes), source, False, compute]
        )
      else:
        transfers.append([op, _result_bytes(line, shapes), source, True, 0])
    elif opcode == "while" and (m := _WHILE.search(line)) and _sends(comps, m.group(1)):
      for t in open_.values():
        t[4] += 1
    elif _heavy(opcode, line, comps):
      compute += 1
      hidden += bool(open_)
      for t in open_.values():
        t[4] += 1
  return transfers + list(open_.values()), compute, hidden


_IS_SYNC = '"is_sync":true'


def _while_callers(comps) -> dict[str, str]:
  """Loop body -> the op_name of the while that runs it: per call site, where XLA may
  share one body between several loops (a model's layers)."""
  callers = {}
  for lines in comps.values():
    for line in lines:
      if m := _WHILE.search(line):
        callers[m.group(1)] = n.group(1) if (n := _OP_NAME.search(line)) else ""
  return callers


class Collective(NamedTuple):
  """One collective instruction of a compiled program, from `collectives`."""

  op: str  # "all-gather", "all-reduce", "collective-permute", ...
  # per device, each time it runs: an all-gather's results, a reduce-scatter's operands, else its results
  bytes: int
  where: str  # the loop it runs in (`loop_name`, else the body's name), or "" outside loops
  source: str  # the op_name of the JAX operation it comes from
  exposed: bool  # synchronous, or an async pair with no compute between start and done


def collectives(compiled) -> list[Collective]:
  """Every collective of a compiled program with where it runs and whether compute
  hides it: what `scripts/aot.py --model` lists for a training step."""
  hlo = compiled if isinstance(compiled, str) else compiled.as_text()
  comps, _ = _computations(hlo)
  callers = _while_callers(comps)
  found = []
  kinds = "|".join(COLLECTIVES)
  shapes = _shapes(comps)
  fused = _fusion_bodies(comps)
  for name, lines in comps.items():
    if name in fused:
      continue
    where = (
      (_layers_loop(callers[name]) or loop_name(lines, callers[name]) or name) if name in callers else ""
    )
    # A body XLA shares between layers names the first layer in its ops' metadata; the
    # while that runs it names the layer it runs for.
    layer = re.search(r"layer_\d+", callers.get(name, ""))
    rename = (lambda s, layer=layer: re.sub(r"layer_\d+", layer.group(0), s)) if layer else None
    transfers, _, _ = _walk(comps, lines, kinds, rename, shapes)
    found += [Collective(op, n, where, src, sync or under == 0) for op, n, src, sync, under in transfers]
  return found


def _tuple_elements(shapes: str) -> list[str]:
  """The top-level elements of a tuple shape "(a, (b, c), ...)" (dims and layouts, as
  in f32[2,8]{1,0}, hold commas of their own)."""
  parts, depth, start = [], 0, 1
  for i, ch in enumerate(shapes):
    depth += ch in "([{"
    depth -= ch in ")]}"
    if (ch == "," and depth == 1) or (ch == ")" and depth == 0):
      parts.append(shapes[start:i].strip())
      start = i + 1
      if depth == 0:
        break
  return parts


# Async starts whose result tuple is ((operands), (results), ...) or (operand, result, ...).
_START_WITH_OPERANDS = (
  "all-gather-start",
  "collective-permute-start",
  "all-to-all-start",
  "reduce-scatter-start",
)
_ARGS = re.compile(r"%([\w.\-]+)")


def _operand_names(line: str, opcode: str) -> list[str]:
  """The operand names of one instruction line (names and comments hold no parenthesis)."""
  return _ARGS.findall(line.split(f" {opcode}(", 1)[1].split(")", 1)[0])


def _shapes(comps) -> dict[str, str]:
  """instruction name -> its shape text, over every computation (names are unique in
  a module)."""
  found = {}
  for lines in comps.values():
    for line in lines:
      if ins := _instruction(line):
        found[ins[0]] = line.split("= ", 1)[1].split(f" {ins[1]}(", 1)[0]
  return found


def _result_bytes(line: str, shapes: dict[str, str] | None = None) -> int:
  """Bytes per device of the arrays a collective instruction moves, all of them where
  one op gathers or reduces several: an all-gather's results (gathered), a
  reduce-scatter's operands (what every device reduces: its results are 1 / n of
  them), any other's results (an all-to-all's and a permute's equal what they send).
  An async start's result is ((operands), (results)) or (operand, result,
  contexts...); a synchronous reduce-scatter's operands are read from `shapes`
  (`_shapes`), its results where they are not given."""
  ins = _instruction(line)
  if ins is None:
    return 0
  text = line.split("= ", 1)[1].split(f" {ins[1]}(", 1)[0]
  if ins[1] in _START_WITH_OPERANDS and text.startswith("("):
    text = _tuple_elements(text)[0 if ins[1] == "reduce-scatter-start" else 1]
  elif ins[1] == "reduce-scatter" and shapes is not None:
    operands = [shapes.get(name) for name in _operand_names(line, ins[1])]
    if operands and None not in operands:
      text = " ".join(operands)
  return shape_bytes(text)


_OP_NAME = re.compile(r'op_name="([^"]*)"')


def loop_name(lines, caller: str = "") -> str:
  """What a ring loop is, read from source names (`op_name` metadata): "forward ring
  step" or "backward ring step" from its collective-permutes (jax_ring's named scopes;
  a body traced under `transpose(...)` is a backward one); "... ring pass edges" for a
  loop over head groups whose permutes are a pass's first and last transfers (before
  its first step, and the dK/dV sent home after its last); and from `caller`, the
  op_name of the while that runs it, the model layer (`layer_3`: models.DecoderLM's
  scopes) and LongNet pattern (`pattern_w2048_r2`). XLA may share one body between
  layers, so the layer comes from the call site. "" when the program has no names."""
  names = [m.group(1) for line in lines if " collective-permute" in line and (m := _OP_NAME.search(line))]
  if not names:
    return ""
  source = names[0]
  backward = "backward_ring" in source or ("forward_ring" not in source and "transpose(" in source + caller)
  direction = "backward" if backward else "forward"
  if "_ring_step" in source:
    what = f"{direction} ring step"
  elif "_ring_pass" in source:  # a loop over head groups: each pass's first and last transfers
    what = f"{direction} ring pass edges"
  else:
    what = f"{direction} ring loop"
  parts = [what]
  where = caller or names[0]
  if layer := re.search(r"layer_(\d+)", where):
    parts.append(f"layer {layer.group(1)}")
  if pattern := re.search(r"pattern_w(\d+)_r(\d+)", where):
    parts.append(f"pattern w={pattern.group(1)} r={pattern.group(2)}")
  return ", ".join(parts)


def _layers_loop(caller: str) -> str:
  """ "forward layers loop" or "backward layers loop" for the while of a model's scan
  over its blocks (its op_name a `while` outside the attention and every `shard_map`;
  the attention's ring loops run inside it, and XLA may hoist a ring pass's first and
  last transfers into its body), else ""."""
  parts = caller.split("/")
  if parts[-1] != "while" or parts.count("while") > 1 or "ring_attention" in caller or "shard_map" in caller:
    return ""
  return ("backward" if "transpose(" in caller else "forward") + " layers loop"


def _sends(comps, body: str) -> bool:
  """Whether computation `body` itself holds a collective-permute."""
  return any(re.search(r" collective-permute(-start)?\(", line) for line in comps.get(body, ()))


def _operand(line: str) -> str:
  m = re.search(r"\(%([\w.\-]+)", line.split("=", 1)[1])
  return m.group(1) if m else ""


def collective_bytes(compiled) -> dict[str, int]:
  """op name ("all-to-all", "collective-permute", ...) -> its bytes per device
  (`_result_bytes`: a reduce-scatter's operands, else its results) over one run of
  the program; ops that do not occur are absent.

  `compiled`: a `jax.stages.Compiled` or its `as_text()`. Raises ValueError for a
  loop with collectives whose trip count XLA did not record."""
  cost, _, entry = _collective_costs(compiled)
  return dict(cost(entry))


def branch_collective_bytes(compiled) -> list[list[dict[str, int]]]:
  """For each conditional of the program whose branches hold collectives, in program
  order: each branch's `collective_bytes` (what one run of that branch moves). A call
  with `document_bound="auto"` picks one of its schedules this way while running."""
  cost, comps, _ = _collective_costs(compiled)
  out = []
  for lines in comps.values():
    for line in lines:
      if _OP.search(line) or _WHILE.search(line) or not (m := _BRANCHES.search(line)):
        continue
      names = m.group(1).split(",") if m.group(1) else [m.group(2), m.group(3)]
      branches = [dict(cost(n.strip().lstrip("%"))) for n in names]
      if any(branches):
        out.append(branches)
  return out


def _collective_costs(compiled):
  """(cost, computations, entry): cost(name) is the (op, bytes) pairs one run of
  computation `name` moves, loops counted by their trip counts and a conditional by
  its costliest branch."""
  hlo = compiled if isinstance(compiled, str) else compiled.as_text()
  comps, entry = _computations(hlo)
  shapes = _shapes(comps)

  @functools.cache
  def cost(name: str) -> tuple[tuple[str, int], ...]:
    found: dict[str, int] = {}

    def add(part, times=1):
      for op, n in part:
        found[op] = found.get(op, 0) + n * times

    for line in comps.get(name, ()):
      if m := _OP.search(line):
        found[m.group(2)] = found.get(m.group(2), 0) + _result_bytes(line, shapes)
      elif m := _WHILE.search(line):
        body = cost(m.group(1))
        trips = trip_count(line, comps) if body else 0
        if trips is None:
          raise ValueError(f"a while loop with collectives has no known trip count: {line.strip()[:200]}")
        add(body, trips)
      elif m := _BRANCHES.search(line):
        names = m.group(1).split(",") if m.group(1) else [m.group(2), m.group(3)]
        branches = [dict(cost(n.strip().lstrip("%"))) for n in names]
        add(max((tuple(b.items()) for b in branches), key=lambda b: sum(n for _, n in b)))
      elif (ins := _instruction(line)) and ins[1] == "fusion":
        # A TPU async collective counts once, at its start (its steps and its done
        # hold the same collective).
        tpu = _TPU_ASYNC.fullmatch(ins[0])
        if tpu and tpu.group(1) == "start" and (one := _fused_collective(comps, line, shapes)):
          add([one[:2]])
      else:
        for called in _CALLS.findall(line):
          add(cost(called))
    return tuple(found.items())

  return cost, comps, entry


def loop_free_collectives(compiled) -> list[tuple[str, int]]:
  """(op name, bytes per device as `collective_bytes` counts them) of every collective
  outside all while loops, in program order: what a program moves besides its loops
  (the ring steps). A model that relays its tokens for every layer's attention shows
  two collective-permutes per array and layer here; one that keeps the ring's order
  shows none.

  `compiled`: a `jax.stages.Compiled` or its `as_text()`."""
  hlo = compiled if isinstance(compiled, str) else compiled.as_text()
  comps, entry = _computations(hlo)
  shapes = _shapes(comps)
  found: list[tuple[str, int]] = []

  def visit(name: str) -> None:
    for line in comps.get(name, ()):
      if m := _OP.search(line):
        found.append((m.group(2), _result_bytes(line, shapes)))
      elif _WHILE.search(line):
        continue
      elif m := _BRANCHES.search(line):
        for n in m.group(1).split(",") if m.group(1) else [m.group(2), m.group(3)]:
          visit(n.strip().lstrip("%"))
      elif (ins := _instruction(line)) and ins[1] == "fusion":
        tpu = _TPU_ASYNC.fullmatch(ins[0])
        if tpu and tpu.group(1) == "start" and (one := _fused_collective(comps, line, shapes)):
          found.append(one[:2])
      else:
        for called in _CALLS.findall(line):
          visit(called)

  visit(entry)
  return found


_ROOT_OP = re.compile(r"^\s*ROOT %[\w.\-]+ = .*? (copy|transpose)\(")


def loop_free_copies(compiled, min_bytes: int = 0) -> list[tuple[str, int]]:
  """(op name, result bytes per device) of every copy and transpose outside all while
  loops (the op itself, or a fusion whose root is one), in program order, of at least
  `min_bytes`: each holds a second copy of an array in another layout while both live.
  XLA inserts one where two users of an array want different layouts; one outside the
  layers' loop that copies a whole stack of layer inputs holds all of them twice.

  `compiled`: a `jax.stages.Compiled` or its `as_text()`."""
  hlo = compiled if isinstance(compiled, str) else compiled.as_text()
  comps, entry = _computations(hlo)
  found: list[tuple[str, int]] = []

  def rooted(name: str) -> str | None:
    for line in comps.get(name, ()):
      if m := _ROOT_OP.match(line):
        return m.group(1)
    return None

  def visit(name: str) -> None:
    for line in comps.get(name, ()):
      op = _instruction(line)
      if op is None or _WHILE.search(line):
        continue
      kind = op[1] if op[1] in ("copy", "transpose") else None
      if op[1] == "fusion":
        kind = next(filter(None, map(rooted, _CALLS.findall(line))), None)
      elif kind is None:
        for called in _CALLS.findall(line):
          visit(called)
      if kind is not None:
        size = shape_bytes(line.split(" = ", 1)[1].split(f" {op[1]}(", 1)[0])
        if size >= min_bytes:
          found.append((kind, size))

  visit(entry)
  return found


def _carried_unread(lines) -> set[str]:
  """Names of a loop body's values whose only readers are the body's ROOT tuple (the
  carry), directly or through bitcasts and copies of them alone."""
  users: dict[str, list[tuple[str, str]]] = {}
  root = None
  for line in lines:
    ins = _instruction(line)
    if ins is None:
      continue
    name, opcode = ins
    if line.lstrip().startswith("ROOT"):
      root = name
    for operand in re.findall(r"%([\w.\-]+)", line.split("=", 1)[1]):
      users.setdefault(operand, []).append((name, opcode))

  def unread(name, depth=0):
    found = users.get(name, [])
    return (
      bool(found)
      and depth < 8
      and all(
        user == root or (opcode in ("bitcast", "copy") and unread(user, depth + 1)) for user, opcode in found
      )
    )

  return {name for name in users if unread(name)}


class HostTransfer(NamedTuple):
  """One asynchronous copy between a device and its host's memory inside a loop body
  (remat "offload": a layer's input going out in the forward pass, coming back in the
  backward), from `host_transfers`."""

  body: str  # the loop body it runs in
  direction: str  # "to host" or "from host"
  bytes: int  # the device-side array's bytes
  compute: int  # heavy ops (`_heavy`) between its start and its done
  # Read in a later iteration than its start: its done lies there (XLA's pipeliner), or
  # a copy back's result goes into the loop's carry unread (issued one layer ahead).
  prefetched: bool


_HOST = ":S(5)}"  # the pinned host memory space in a scheduled module's layouts


def host_transfers(compiled) -> list[HostTransfer]:
  """Every asynchronous host copy in a loop body of a compiled program (a `fusion-start`
  or `copy-start` with an operand or result in host memory, and its done) and the
  compute between its start and done. A copy back from the host that the loop body
  starts and also waits for has only that compute to hide under, unless the iteration
  only carries its result to the next one, which reads it; one started an iteration
  ahead or read in the next (`prefetched`) has a whole iteration. `compiled`: a
  `jax.stages.Compiled` or its `as_text()`."""
  hlo = compiled if isinstance(compiled, str) else compiled.as_text()
  comps, _ = _computations(hlo)
  found = []
  for body in sorted(_while_callers(comps)):
    open_: dict[str, list] = {}
    lines = comps.get(body, ())
    carried = _carried_unread(lines)
    for line in lines:
      ins = _instruction(line)
      if ins is None:
        continue
      name, opcode = ins
      if opcode in ("fusion-start", "copy-start") and _HOST in line:
        shapes = line.split("= ", 1)[1].split(f" {opcode}(", 1)[0]
        parts = _tuple_elements(shapes) if shapes.startswith("(") else [shapes]
        result = parts[1] if len(parts) > 1 else parts[0]
        if _HOST in result:  # device -> host: the update sent out
          operands = _tuple_elements(parts[0]) if parts[0].startswith("(") else [parts[0]]
          device = [p for p in operands if _HOST not in p and "[]" not in p]
          open_[name] = ["to host", shape_bytes(device[0]) if device else 0, 0]
        else:
          open_[name] = ["from host", shape_bytes(result), 0]
      elif opcode in ("fusion-done", "copy-done") and _operand(line) in open_:
        direction, size, compute = open_.pop(_operand(line))
        ahead = direction == "from host" and name in carried
        found.append(HostTransfer(body, direction, size, compute, ahead))
      elif _heavy(opcode, line, comps):
        for t in open_.values():
          t[2] += 1
    for direction, size, compute in open_.values():  # done in the next iteration
      found.append(HostTransfer(body, direction, size, compute, True))
  return found
