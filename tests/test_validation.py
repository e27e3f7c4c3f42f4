"""Bad input raises a clear ValueError/TypeError naming the argument, before XLA."""

import warnings

import jax
import jax.numpy as jnp
import pytest
from conftest import make_mesh
from jax.sharding import PartitionSpec as P

import jax_ring
import jax_ring.nn

MESH = make_mesh((2,), ("seq",))
MESH_AUTO = jax.make_mesh((2,), ("seq",), devices=jax.devices()[:2], axis_types=(jax.sharding.AxisType.Auto,))
Q = jnp.zeros((2, 8, 4, 8))
KV = jnp.zeros((2, 8, 2, 8))


def call(**overrides):
  args = {"query": Q, "key": KV, "value": KV}
  kwargs = {"mesh": MESH}
  for name, value in overrides.items():
    (args if name in args else kwargs)[name] = value
  return jax_ring.ring_attention(args["query"], args["key"], args["value"], **kwargs)


@pytest.mark.parametrize(
  "overrides, error, pattern",
  [
    ({"query": jnp.zeros((2, 8, 32))}, ValueError, r"query\.shape=\(2, 8, 32\) must have rank 4"),
    ({"query": jnp.zeros((3, 8, 4, 8))}, ValueError, r"key batch=2 must equal query batch=3"),
    ({"query": jnp.zeros((2, 8, 4, 16))}, ValueError, r"key head_dim=8 must equal query head_dim=16"),
    ({"query": jnp.zeros((2, 8, 3, 8))}, ValueError, r"num_heads=3 must be a multiple of num_kv_heads=2"),
    ({"value": jnp.zeros((2, 8, 1, 8))}, ValueError, r"key\.shape=.* must equal value\.shape"),
    (
      {
        "key": jnp.zeros((2, 6, 2, 8)),
        "value": jnp.zeros((2, 6, 2, 8)),
        "segment_ids": jnp.zeros((2, 8), int),
      },
      ValueError,
      r"segment_ids is one array, but key length S=6 != query length T=8: pass a pair",
    ),
    (
      {"segment_ids": (jnp.zeros((2, 8), int), jnp.zeros((2, 5), int))},
      ValueError,
      r"segment_ids\[1\] \(kv ids\)\.shape=\(2, 5\) must be \(batch, seq\)=\(2, 8\)",
    ),
    ({"segment_ids": (jnp.zeros((2, 8), int),)}, TypeError, r"segment_ids is a sequence of 1"),
    (
      {"query_seq_lengths": jnp.array([8, 9], jnp.int32)},
      ValueError,
      r"query_seq_lengths=\[8, 9\] must lie in \[0, 8\]",
    ),
    (
      {"key": jnp.zeros((2, 6, 2, 8)), "value": jnp.zeros((2, 6, 2, 8)), "key_value_seq_lengths": [6, 7]},
      ValueError,
      r"key_value_seq_lengths=\[6, 7\] must lie in \[0, 6\]",
    ),
    ({"query_seq_lengths": jnp.array([-1, 2])}, ValueError, r"query_seq_lengths=\[-1, 2\] must lie in"),
    (
      {"query_seq_lengths": jnp.array([4])},
      ValueError,
      r"query_seq_lengths\.shape=\(1,\) must be \(batch,\)=\(2,\)",
    ),
    ({"key_value_seq_lengths": jnp.array([4.0, 2.0])}, TypeError, r"key_value_seq_lengths\.dtype=float"),
    ({"return_residual": 1}, TypeError, r"return_residual=1 must be a bool"),
    (
      {"query": jnp.zeros((8, 4, 8))},
      ValueError,
      r"query\.shape=\(8, 4, 8\) must have rank 4.*or query, key and value all rank 3",
    ),
    ({"query": jnp.zeros((2, 8, 4, 8), jnp.int32)}, TypeError, r"query\.dtype=int32 must be a floating"),
    ({"segment_ids": jnp.zeros((2, 7), jnp.int32)}, ValueError, r"segment_ids\.shape=\(2, 7\)"),
    ({"segment_ids": jnp.zeros((2, 8))}, TypeError, r"segment_ids\.dtype=float.* must be an integer"),
    ({"local_window_size": -1}, ValueError, r"local_window_size=-1 must be non-negative"),
    ({"local_window_size": (3, -2)}, ValueError, r"local_window_size=\(3, -2\) must be non-negative"),
    ({"local_window_size": 2.5}, TypeError, r"local_window_size=2.5 must be an int"),
    ({"seq_axis": "sequence"}, ValueError, r"seq_axis='sequence' is not an axis of the mesh"),
    ({"batch_axis": "data"}, ValueError, r"batch_axis='data' is not an axis of the mesh"),
    ({"head_axis": "seq"}, ValueError, r"must name different mesh axes"),
    ({"mesh": "mesh"}, TypeError, r"mesh='mesh' must be a jax.sharding.Mesh"),
    ({"layout": "spiral"}, ValueError, r"Unsupported layout='spiral'"),
    ({"policy": "int8"}, ValueError, r"policy='int8' is not a preset"),
    ({"scale": -1.0}, ValueError, r"scale=-1.0 must be a finite positive"),
    ({"block_sizes": (4, 4)}, TypeError, r"block_sizes=\(4, 4\) must be a jax_ring.BlockSizes"),
  ],
)
def test_errors_name_the_argument(overrides, error, pattern):
  with pytest.raises(error, match=pattern):
    call(**overrides)


def test_batch_not_divisible_by_batch_axis():
  mesh = make_mesh((3, 2), ("data", "seq"))
  with pytest.raises(
    ValueError, match=r"batch=2 must be divisible by the size 3 of mesh axis batch_axis='data'"
  ):
    jax_ring.ring_attention(Q, KV, KV, mesh=mesh, batch_axis="data")


def test_kv_heads_not_divisible_by_head_axis():
  mesh = make_mesh((2, 4), ("seq", "heads"))
  with pytest.raises(ValueError, match=r"num_kv_heads=2 must be divisible by the size 4"):
    jax_ring.ring_attention(Q, KV, KV, mesh=mesh, head_axis="heads")


def test_block_sizes_validated():
  with pytest.raises(ValueError, match=r"BlockSizes.block_q=0 must be a positive int"):
    jax_ring.BlockSizes(block_q=0)


def test_reference_validates_too():
  with pytest.raises(ValueError, match=r"num_heads=3 must be a multiple of num_kv_heads=2"):
    jax_ring.reference_attention(jnp.zeros((1, 4, 3, 8)), jnp.zeros((1, 4, 2, 8)), jnp.zeros((1, 4, 2, 8)))


def test_kv_heads_per_pass_validated():
  with pytest.raises(ValueError, match=r"BlockSizes.kv_heads=0 must be a positive int"):
    jax_ring.BlockSizes(kv_heads=0)
  q, kv = jnp.zeros((2, 8, 6, 8)), jnp.zeros((2, 8, 3, 8))
  with pytest.raises(ValueError, match=r"BlockSizes.kv_heads=2 must divide the number of kv heads .* 3"):
    jax_ring.ring_attention(q, kv, kv, mesh=MESH, block_sizes=jax_ring.BlockSizes(kv_heads=2))


def test_mixed_dtypes_are_refused_as_in_jax_nn():
  with pytest.raises(ValueError, match=r"query.dtype=float32, key.dtype=bfloat16, value.dtype=float32"):
    call(query=Q.astype(jnp.float32), key=KV.astype(jnp.bfloat16), value=KV.astype(jnp.float32))
  with pytest.raises(ValueError, match=r"query.dtype=float16, key.dtype=float32, value.dtype=float32"):
    jax_ring.reference_attention(Q.astype(jnp.float16), KV.astype(jnp.float32), KV.astype(jnp.float32))


@pytest.mark.parametrize("flag", ["is_causal", "return_residual"])
def test_flags_must_be_bools(flag):
  """ "False" is a truthy string: taking it as a flag would compute the wrong thing."""
  with pytest.raises(TypeError, match=rf"{flag}='False' must be a bool"):
    call(**{flag: "False"})


@pytest.mark.parametrize(
  "call_with_flag",
  [
    lambda v: jax_ring.reference_attention(Q, KV, KV, is_causal=v),
    lambda v: jax_ring.dilated_attention(Q, KV, KV, segment_lengths=(8,), dilation_rates=(1,), is_causal=v),
    lambda v: jax_ring.reference_dilated_attention(
      Q, KV, KV, segment_lengths=(8,), dilation_rates=(1,), is_causal=v
    ),
    lambda v: jax_ring.work_report(layout="contiguous", num_devices=2, seq_len=16, is_causal=v),
    lambda v: jax_ring.nn.make_attention_fn(mesh=MESH, is_causal=v),
  ],
)
def test_is_causal_must_be_a_bool_everywhere(call_with_flag):
  with pytest.raises(TypeError, match=r"is_causal='yes' must be a bool"):
    call_with_flag("yes")


@pytest.mark.parametrize("name", ["mask", "bias"])
def test_dense_mask_or_bias_names_what_to_use_instead(name):
  with pytest.raises(ValueError, match=r"no dense .*is_causal, local_window_size=.*segment_ids"):
    call(**{name: jnp.ones((2, 4, 8, 8), bool)})


def _shard_call(**options):
  """ring_attention_shard inside a shard_map over MESH's "seq" axis."""
  inner = lambda q, k, v: jax_ring.ring_attention_shard(q, k, v, **options)
  seq = P(None, "seq")
  return jax.shard_map(inner, mesh=MESH_AUTO, in_specs=(seq, seq, seq), out_specs=seq)(Q, KV, KV)


def test_shard_variant_names_an_unbound_axis():
  with pytest.raises(ValueError, match=r"axis_name='ring' is not an axis of a surrounding jax.shard_map"):
    _shard_call(axis_name="ring")
  with pytest.raises(ValueError, match=r"axis_name='seq' is not an axis of a surrounding jax.shard_map"):
    jax_ring.ring_attention_shard(Q, KV, KV, axis_name="seq")  # no shard_map at all


def test_shard_variant_refuses_auto_layout():
  """Only the caller knows how its shards are laid out: "auto" would guess (zigzag when
  causal) and compute wrong answers for natural-order shards."""
  with pytest.raises(ValueError, match=r"layout='auto'.*'contiguous'.*jax_ring.layouts.to_layout"):
    _shard_call(axis_name="seq", layout="auto", is_causal=True)


def test_silent_surprises_are_said_once(monkeypatch, caplog):
  """An axis no argument names repeats the work on every device along it: a UserWarning
  naming it, the first time only (not once per call or per layer). A length the ring
  does not divide is supported input (its output comes back replicated): no warning,
  one INFO record on the "jax_ring" logger naming the length."""
  from jax_ring import _validation

  monkeypatch.setattr(_validation, "_NOTICED", set())
  mesh = make_mesh((2, 4), ("data", "seq"))
  x = jnp.ones((2, 30, 4, 16))
  with pytest.warns(UserWarning) as seen, caplog.at_level("INFO", logger="jax_ring"):
    out = jax_ring.ring_attention(x, x, x, mesh=mesh)
    jax_ring.ring_attention(x, x, x, mesh=mesh)
  messages = [str(w.message) for w in seen]
  assert len(messages) == 1, messages
  assert "mesh axis 'data' (size 2) is not named" in messages[0] and "batch_axis='data'" in messages[0]
  logged = [r.getMessage() for r in caplog.records if r.name == "jax_ring"]
  assert len(logged) == 1 and "length 30 does not divide by the 4 devices" in logged[0], logged
  assert out.sharding.spec == P()  # what the record says: replicated, not sharded along "seq"
  monkeypatch.setattr(_validation, "_NOTICED", set())
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # an uneven length on named axes: no warning at all
    jax_ring.ring_attention(x, x, x, mesh=make_mesh((4,), ("seq",)))
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # named axes, a length the ring divides: nothing to say
    y = jnp.ones((2, 32, 4, 16))
    assert jax_ring.ring_attention(y, y, y, mesh=mesh, batch_axis="data").sharding.spec[1] == "seq"
    jax_ring.dilated_attention(
      y, y, y, segment_lengths=(8,), dilation_rates=(1,), mesh=mesh, batch_axis="data"
    )
  with pytest.warns(UserWarning, match="jax_ring.KV cache: mesh axis 'data'"):
    jax_ring.init_cache(2, 64, 4, 16, mesh=mesh)


def test_decoding_on_another_mesh_names_both_meshes():
  import jax

  first, second = (jax.make_mesh((4,), ("seq",), devices=jax.devices()[i : i + 4]) for i in (0, 4))
  cache = jax_ring.init_cache(1, 64, 2, 16, mesh=first)
  q = jnp.ones((1, 1, 4, 16))
  with pytest.raises(
    ValueError, match=r"cache lives on mesh \{'seq': 4\} over devices \[0, 1, 2, 3\], but .* \[4, 5, 6, 7\]"
  ):
    jax_ring.decode_attention(q, cache, mesh=second)
  with pytest.raises(ValueError, match="cache lives on mesh"):
    jax_ring.update_cache(cache, jnp.ones((1, 1, 2, 16)), jnp.ones((1, 1, 2, 16)), mesh=second)
  assert jax_ring.decode_attention(q, cache, mesh=first).shape == q.shape
