"""Bad input raises a clear ValueError/TypeError naming the argument, before XLA."""

import jax.numpy as jnp
import pytest
from conftest import make_mesh

import jax_ring

MESH = make_mesh((2,), ("seq",))
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
