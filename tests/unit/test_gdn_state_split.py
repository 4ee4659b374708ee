"""Batch invariance of the Gated DeltaNet layer: in a mixed step, the rows that continue a state
with one token take the single-token kernels, the rest the varlen ones (`StateSplit`).

- `plan_state_split` on the host: None for a pure state decode and for a step without decode
  rows; the step's own order (no gather) when the decodes lead; a stable decodes-first
  permutation of the token rows otherwise, with the rest's offsets and flags;
- the GDN layer alone (float32, the PyTorch twins and the Triton kernels under the CPU
  interpreter): a decode row computed in a mixed step (decodes leading, or interleaved with
  prompt chunks and fresh rows) gives bitwise the output and the state of the same row in a
  pure-decode step; the prefill rows match the same requests run alone; steps with only
  prefill rows, only decode rows, or one-token fresh rows keep working;
- the whole dummy:tiny-qwen3.5 model (float32, reference path): a decode row's logits and GDN
  state are bitwise those of the pure-decode step, whatever prefilled beside it.
"""

from __future__ import annotations

import copy
import os

# Triton reads this when triton.language is first imported (kernels import it lazily, at launch);
# the PyTorch twins and the model's reference path do not look at it.
os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from tandem.engine_service.worker.input_batch import assemble_host_inputs, host_to_device, plan_state_split  # noqa: E402
from tandem.engine_service.layers.attention import AttentionMetadata  # noqa: E402
from tandem.engine_service.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetShape  # noqa: E402
from tandem.engine_service.worker.loader import build_model, resolve_model  # noqa: E402

BLOCK_SIZE = 4
SHAPE = GatedDeltaNetShape(hidden_size=48, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16,
                           conv_kernel=4, eps=1e-6, split_projections=True)
NUM_SLOTS = 12
CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread is faster than several fighting over a shared box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


_linear = torch.nn.functional.linear


def _row_by_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    out = torch.cat([_linear(rows[i : i + 1], weight, bias) for i in range(rows.shape[0])])
    return out.reshape(*x.shape[:-1], weight.shape[0])


@pytest.fixture(autouse=True)
def batch_invariant_matmuls(monkeypatch):
    """A BLAS matmul's rounding depends on how many rows it gets (MKL, like cuBLAS, picks its
    blocking by shape), whatever the GDN kernels do; one row per call makes the projections
    batch-invariant, so the bitwise checks below see only which state kernels a row takes."""
    monkeypatch.setattr(torch.nn.functional, "linear", _row_by_row_linear)


# -- the host-side plan ------------------------------------------------------------------------


def plan(query_lens: list[int], seq_lens: list[int]):
    q = np.asarray(query_lens, dtype=np.int64)
    loc = np.zeros(len(q) + 1, dtype=np.int32)
    np.cumsum(q, out=loc[1:])
    slots = np.arange(10, 10 + len(q), dtype=np.int32)
    return plan_state_split(q, slots, np.asarray(seq_lens) > q, loc)


def test_plan_is_none_for_pure_state_decode_and_for_steps_without_decodes() -> None:
    assert plan([1, 1, 1], [5, 9, 2]) is None  # every row a state decode
    assert plan([4, 3], [4, 10]) is None  # prompt chunks only
    assert plan([1, 1], [1, 1]) is None  # one-token fresh prompts are not decodes


def test_plan_keeps_the_step_order_when_decodes_lead() -> None:
    split = plan([1, 1, 3, 1], [6, 2, 3, 1])  # decodes, then a fresh prompt and a fresh 1-token one
    assert split.num_decodes == 2 and split.rows is None
    assert split.state_indices.tolist() == [10, 11, 12, 13]
    assert split.has_initial_state.tolist() == [False, False]
    assert split.query_start_loc.tolist() == [0, 3, 4]


def test_plan_permutes_interleaved_rows_stably() -> None:
    # rows: 0-2 chunk (continues), 3 decode, 4-5 fresh, 6 decode, 7 fresh 1-token
    split = plan([3, 1, 2, 1, 1], [9, 7, 2, 3, 1])
    assert split.num_decodes == 2
    assert split.rows.tolist() == [3, 6, 0, 1, 2, 4, 5, 7]
    assert split.rows.dtype == np.int64
    assert split.state_indices.tolist() == [11, 13, 10, 12, 14]
    assert split.state_indices.dtype == np.int32
    assert split.has_initial_state.tolist() == [True, False, False]
    assert split.query_start_loc.tolist() == [0, 3, 5, 6]


# -- the layer alone ---------------------------------------------------------------------------


def make_layer(fused: bool) -> GatedDeltaNet:
    layer = GatedDeltaNet(SHAPE, fused=fused)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":
                p.copy_(torch.empty(p.shape).uniform_(0.05, 1.0, generator=gen).log())
            elif name == "norm.weight":
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return layer


def make_state() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    (conv_shape, rec_shape) = SHAPE.state_shapes()
    return (torch.randn(NUM_SLOTS + 1, *conv_shape, generator=gen),
            0.2 * torch.randn(NUM_SLOTS + 1, *rec_shape, generator=gen))


def metadata_for(entries: list[tuple[int, int, int]]) -> AttentionMetadata:
    """Step metadata through the engine's own builder; entry = (new tokens, seq_len, slot)."""
    query_lens = [n for n, _, _ in entries]
    seq_lens = [s for _, s, _ in entries]
    tables = [[list(range(-(-s // BLOCK_SIZE))) for s in seq_lens]]  # one paged group (unread here)
    host = assemble_host_inputs([[0] * n for n in query_lens], query_lens, seq_lens, tables, [True] * len(entries),
                                BLOCK_SIZE, np.zeros(0, np.int64), np.zeros(0, np.int64), [s for *_, s in entries])
    return host_to_device(host, CPU).metadata


# request name -> (new tokens this step, seq_len after it, slot): decodes d0..d7 continue a
# state, "chunk" continues one with 5 tokens, "fresh" starts from zeros (its slot holds
# garbage), "one" is a fresh one-token prompt (not a decode: it starts a state).
# Eight decodes: their g and beta ([D, HV] = 32 elements, computed in split order, decodes
# first) then fill whole SIMD blocks in both steps. PyTorch's CPU loops run a tensor's tail past
# the last full vector block through the scalar function, whose last bit may differ from the
# vector one, so with a ragged count a row's g would depend on the step's size on CPU (CUDA
# elementwise kernels have no such tail).
REQUESTS = {"d0": (1, 9, 2), "d1": (1, 4, 5), "d2": (1, 13, 0), "d3": (1, 2, 9), "d4": (1, 7, 11),
            "d5": (1, 5, 8), "d6": (1, 21, 1), "d7": (1, 3, 10), "chunk": (5, 11, 6), "fresh": (6, 6, 3),
            "one": (1, 1, 7)}
INPUTS = {name: torch.randn(n, SHAPE.hidden_size, generator=torch.Generator().manual_seed(10 + i))
          for i, (name, (n, _, _)) in enumerate(REQUESTS.items())}
DECODES = [f"d{i}" for i in range(8)]


def run_layer(layer: GatedDeltaNet, names: list[str]):
    """One step of requests `names` (in that row order) from the seeded state; each request's
    output rows, and the state pools after the step."""
    state = make_state()
    metadata = metadata_for([REQUESTS[n] for n in names])
    with torch.no_grad():
        out = layer(torch.cat([INPUTS[n] for n in names]), state, metadata)
    rows, start = {}, 0
    for n in names:
        rows[n] = out[start : start + REQUESTS[n][0]]
        start += REQUESTS[n][0]
    return rows, state, metadata


def slot_state(state, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    slot = REQUESTS[name][2]
    return state[0][slot], state[1][slot]


ORDERS = {
    "decodes-lead": [*DECODES, "chunk", "fresh", "one"],
    "interleaved": ["d3", "chunk", "d1", "d6", "fresh", "d0", "d7", "one", "d2", "d5", "d4"],
}


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("fused", [False, True], ids=["torch", "triton-interpret"])
def test_decode_rows_of_a_mixed_step_match_a_pure_decode_step_bitwise(order: str, fused: bool) -> None:
    layer = make_layer(fused)
    mixed, mixed_state, metadata = run_layer(layer, ORDERS[order])
    split = metadata.state_split
    assert split is not None and split.num_decodes == len(DECODES)
    assert (split.rows is None) == (order == "decodes-lead")
    pure, pure_state, pure_md = run_layer(layer, DECODES)
    assert pure_md.is_state_decode and pure_md.state_split is None
    for name in DECODES:
        assert torch.equal(mixed[name], pure[name]), name
        for got, want in zip(slot_state(mixed_state, name), slot_state(pure_state, name)):
            assert torch.equal(got, want), name
    # The other rows: as when each of those requests runs alone (varlen kernels either way).
    for name in ("chunk", "fresh", "one"):
        alone, alone_state, _ = run_layer(layer, [name])
        torch.testing.assert_close(mixed[name], alone[name], atol=1e-5, rtol=1e-5)
        for got, want in zip(slot_state(mixed_state, name), slot_state(alone_state, name)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # Slots of requests not in the step are untouched.
    untouched = make_state()
    used = {REQUESTS[n][2] for n in ORDERS[order]}
    for slot in set(range(NUM_SLOTS + 1)) - used:
        assert torch.equal(mixed_state[0][slot], untouched[0][slot])
        assert torch.equal(mixed_state[1][slot], untouched[1][slot])


@pytest.mark.parametrize("names", [["chunk", "fresh"], ["one", "fresh"], DECODES[:3], ["d2", "d0"]],
                         ids=["prefill-only", "fresh-only", "decode-only", "decode-only-reordered"])
def test_steps_without_a_split_take_one_kernel_set(names: list[str]) -> None:
    layer = make_layer(False)
    together, together_state, metadata = run_layer(layer, names)
    assert metadata.state_split is None
    for name in names:
        alone, alone_state, _ = run_layer(layer, [name])
        torch.testing.assert_close(together[name], alone[name], atol=1e-5, rtol=1e-5)
        for got, want in zip(slot_state(together_state, name), slot_state(alone_state, name)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_mixed_step_with_decode_rows_but_no_split_is_refused() -> None:
    layer = make_layer(False)
    metadata = metadata_for([REQUESTS[n] for n in ("chunk", "d0")])
    metadata.state_split = None
    x = torch.cat([INPUTS["chunk"], INPUTS["d0"]])
    with pytest.raises(ValueError, match="state_split"):
        layer(x, make_state(), metadata)


# -- the whole model ---------------------------------------------------------------------------


class TinyHybrid:
    """dummy:tiny-qwen3.5 in float32 on the reference path, over hand-made caches."""

    NUM_BLOCKS = 64

    def __init__(self) -> None:
        self.model = build_model(resolve_model("dummy:tiny-qwen3.5"), "cpu", torch.float32)
        layout = self.model.cache_layout("float32")
        self.caches: list = [None] * self.model.config.num_hidden_layers
        gen = torch.Generator().manual_seed(5)
        for group in layout.groups:
            for layer in group.layer_ids:
                if group.paged:
                    spec = group.spec
                    self.caches[layer] = torch.zeros(2, self.NUM_BLOCKS, BLOCK_SIZE, spec.num_kv_heads,
                                                     spec.head_dim)
                else:
                    self.caches[layer] = tuple(torch.randn(NUM_SLOTS + 1, *s, generator=gen)
                                               for s in group.spec.shapes)
        self.state_layers = [i for i, c in enumerate(self.caches) if isinstance(c, tuple)]
        self.tables: dict[str, list[int]] = {}
        self.next_block = 0

    @torch.inference_mode()
    def step(self, work: list[tuple[str, list[int], int, int]]) -> dict[str, torch.Tensor]:
        """work = (name, tokens run, tokens computed before, slot); each request's logits rows."""
        for name, tokens, start, _ in work:
            table = self.tables.setdefault(name, [])
            while len(table) * BLOCK_SIZE < start + len(tokens):
                table.append(self.next_block)
                self.next_block += 1
        host = assemble_host_inputs([t for _, t, _, _ in work], [len(t) for _, t, _, _ in work],
                                    [s + len(t) for _, t, s, _ in work], [[self.tables[n] for n, *_ in work]],
                                    [True] * len(work), BLOCK_SIZE, np.zeros(0, np.int64), np.zeros(0, np.int64),
                                    [slot for *_, slot in work])
        inputs = host_to_device(host, CPU)
        md = inputs.metadata
        logits = self.model.compute_logits(self.model(inputs.input_ids, md.positions, self.caches, md))
        out, row = {}, 0
        for name, tokens, _, _ in work:
            out[name] = logits[row : row + len(tokens)]
            row += len(tokens)
        return out


def test_model_decode_rows_are_batch_invariant() -> None:
    gen = torch.Generator().manual_seed(6)
    lengths = {f"r{i}": 3 + 2 * i for i in range(8)}  # eight decodes: see REQUESTS on SIMD tails
    slots = dict(zip(lengths, (4, 1, 9, 0, 12, 7, 2, 10)))
    prompts = {n: torch.randint(3, 320, (k,), generator=gen).tolist() for n, k in lengths.items()}
    new_prompt = torch.randint(3, 320, (11,), generator=gen).tolist()
    base = TinyHybrid()
    base.step([(n, prompts[n], 0, slots[n]) for n in lengths])
    decodes = [(n, [17 + i], lengths[n], slots[n]) for i, n in enumerate(lengths)]
    pure = copy.deepcopy(base)
    want = pure.step(decodes)
    new = ("new", new_prompt, 0, 5)
    for label, work in {
        "decodes-lead": [*decodes, new],
        "interleaved": [decodes[3], new, *decodes[:3], *decodes[4:]],
    }.items():
        mixed = copy.deepcopy(base)
        got = mixed.step(work)
        for name, slot in slots.items():
            assert torch.equal(got[name], want[name]), (label, name)
            for layer in mixed.state_layers:
                for g, w in zip(mixed.caches[layer], pure.caches[layer]):
                    assert torch.equal(g[slot], w[slot]), (label, name, layer)
