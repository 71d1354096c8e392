"""The transformers integration on the shipped model (models/entmaxkv-lm.safetensors): the
port (entmaxkv.hf_lm) equals the training module (train/model.py), and greedy decoding
through EntmaxKVCache and the "entmaxkv" attention function gives the dense forward's tokens
and logits, for the exact methods and float32 or float16 storage. Skipped without torch,
transformers, safetensors or entmax."""
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from entmaxkv.hf import EntmaxKVCache, EntmaxKVLayer  # noqa: E402
from entmaxkv.hf_lm import EntmaxKVLM  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
MODEL = REPO / "models" / "entmaxkv-lm.safetensors"
if not MODEL.exists():
    pytest.skip(f"{MODEL} is not there", allow_module_level=True)
PROMPT = b"The pass key is 12345. Remember it. What is the pass key? The pass key is "
STEPS = 12
# logits (|logit| up to ~25): the same float32 math summed in other orders over 8 layers (a
# batch's matmuls block differently: 1.1e-4 seen, one row alone 1.4e-5)
TOL = 3e-4


@pytest.fixture(scope="module")
def dense():
    return EntmaxKVLM.from_safetensors(MODEL)


@pytest.fixture(scope="module")
def viakv():
    return EntmaxKVLM.from_safetensors(MODEL, attn_implementation="entmaxkv")


def ids(*prompts):
    return torch.tensor([list(p) for p in prompts])


class RoundedDenseCache:
    """The dense forward's K/V kept rounded to the storage dtype, as the paged cache keeps
    them: a prefill attends over its own (unrounded) states, each later step over the stored
    ones, as through EntmaxKVCache. The reference for a float16 cache."""

    def __init__(self, dtype):
        self.dtype, self.kv = dtype, {}

    def update(self, k, v, layer_idx):
        stored = k.to(self.dtype).float(), v.to(self.dtype).float()
        if layer_idx not in self.kv:
            self.kv[layer_idx] = stored
            return k, v
        self.kv[layer_idx] = tuple(torch.cat([a, b], 2) for a, b in zip(self.kv[layer_idx], stored))
        return self.kv[layer_idx]


def dense_greedy(model, x, steps, dtype):
    """Greedy tokens and each step's logits of the dense forward (eager attention)."""
    cache = RoundedDenseCache(dtype)
    logits, toks = [], x
    with torch.no_grad():
        step = model(toks, cache=cache).logits[:, -1]
        for _ in range(steps):
            logits.append(step)
            nxt = step.argmax(-1, keepdim=True)
            toks = torch.cat([toks, nxt], 1)
            step = model(nxt, cache=cache).logits[:, -1]
    return toks, torch.stack(logits, 1)


def kv_greedy(model, x, steps, **cache_kw):
    cache = EntmaxKVCache(model.config.n_layers, num_pages=64, **cache_kw)
    with torch.no_grad():
        out = model.generate(x, cache=cache, max_new_tokens=steps, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits, 1), cache


def test_port_equals_the_training_module(dense):
    pytest.importorskip("entmax")  # train/model.py's entmax
    sys.path.insert(0, str(REPO / "train"))
    try:
        import model as train_model
    finally:
        sys.path.pop(0)
    from safetensors import safe_open

    with safe_open(str(MODEL), framework="pt") as f:
        ref = train_model.LM(train_model.Config.from_metadata(f.metadata()))
        ref.load_state_dict({k: f.get_tensor(k).float() for k in f.keys()})
    x = ids(PROMPT, PROMPT[::-1])
    with torch.no_grad():
        torch.testing.assert_close(dense(x).logits, ref.eval()(x), rtol=0, atol=TOL)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("method,budget", [("dense", 1 / 16), ("certified", 1 / 16),
                                           ("screened", 1 / 16), ("topk", 1.0)])
def test_greedy_through_entmaxkv_equals_dense(dense, viakv, method, budget, dtype):
    x = ids(PROMPT)
    want, want_logits = dense_greedy(dense, x, STEPS, getattr(torch, dtype))
    got, got_logits, cache = kv_greedy(viakv, x, STEPS, method=method, budget=budget,
                                       dtype=dtype)
    assert got.tolist() == want.tolist()
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=TOL)
    assert all(l.get_seq_length() == x.shape[1] + STEPS - 1 for l in cache.layers)
    rep = cache.reports[0]
    assert rep["support"].shape == (1, 6) and (rep["support"] >= 1).all()


def test_the_model_answers_the_pass_key_through_entmaxkv(viakv):
    got, _, _ = kv_greedy(viakv, ids(PROMPT), 5, method="certified")
    assert bytes(got[0, len(PROMPT):].tolist()) == b"12345"


def test_a_batch_decodes_as_its_rows(viakv):
    a, b = PROMPT, PROMPT.replace(b"12345", b"80417")
    got, logits, _ = kv_greedy(viakv, ids(a, b), 6, method="certified")
    for row, p in enumerate((a, b)):
        one, one_logits, _ = kv_greedy(viakv, ids(p), 6, method="certified")
        assert got[row].tolist() == one[0].tolist()
        torch.testing.assert_close(logits[row], one_logits[0], rtol=0, atol=TOL)


def test_errors(viakv):
    cache = EntmaxKVCache(viakv.config.n_layers, num_pages=64)
    with torch.no_grad():
        viakv(ids(PROMPT), cache=cache)
        with pytest.raises(NotImplementedError, match="chunked prefill"):
            viakv(ids(b"more"), cache=cache)
        with pytest.raises(ValueError, match="batch of 2"):
            viakv(ids(b"a", b"b"), cache=cache)
        with pytest.raises(NotImplementedError, match="padding"):
            viakv(ids(b"ab"), attention_mask=torch.tensor([[0, 1]]))
    with pytest.raises(NotImplementedError, match="beam"):
        cache.reorder_cache(torch.tensor([0]))
    with pytest.raises(ValueError, match="method"):
        EntmaxKVLayer(method="nope")
    small = EntmaxKVCache(viakv.config.n_layers, num_pages=2, page_size=16)
    with torch.no_grad(), pytest.raises(Exception, match="free page|pages"):
        viakv(ids(PROMPT), cache=small)  # 75 tokens do not fit in 2 pages of 16


def test_reset_starts_over(viakv):
    x = ids(PROMPT)
    first, _, cache = kv_greedy(viakv, x, 4)
    cache.reset()
    assert cache.get_seq_length() == 0
    with torch.no_grad():
        again = viakv.generate(x, cache=cache, max_new_tokens=4, do_sample=False)
    assert again.tolist() == first.tolist()


def test_an_unmodified_transformers_model_decodes_through_entmaxkv():
    """A stock transformers architecture (a small random Llama, RoPE, GQA) with
    attn_implementation="entmaxkv": greedy tokens and logits through EntmaxKVCache equal those
    through transformers' own DynamicCache, where every step is dense entmax attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, attn_implementation="entmaxkv",
                         initializer_range=0.3)  # peaked scores: sparse supports
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None  # ten tokens, whatever they are
    x = torch.randint(0, 97, (1, 30))
    runs = []
    for cache in (None, EntmaxKVCache(2, num_pages=16, dtype="float32", method="certified")):
        with torch.no_grad():
            out = model.generate(x, past_key_values=cache, max_new_tokens=10, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        runs.append((out.sequences, torch.stack(out.logits, 1)))
    assert runs[1][0].tolist() == runs[0][0].tolist()
    torch.testing.assert_close(runs[1][1], runs[0][1], rtol=0, atol=TOL)
    assert cache.get_seq_length() == 39
    assert (cache.reports[1]["support"] < 39).all()  # exact zeros: the test has teeth
