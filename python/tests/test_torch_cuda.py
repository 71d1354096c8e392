"""The CUDA path (CudaPagedKVCache, DecodeWrapper over it) on torch CUDA tensors: decode
against a float64 reference and against the CPU path for every method, the caller's stream,
CUDA graph replay against eager, torch.compile, and the error paths. Skipped where torch has
no CUDA device; where it has one, a library built without the CUDA backend fails here (it
must not pass by skipping on the GPU machine). scripts/gpu_python_tests.sh runs it."""
import numpy as np
import pytest

import entmaxkv
from reference import attention_ref

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

HK, D, H, PS = 2, 64, 8, 16
DEV = torch.device("cuda", torch.cuda.current_device())
TOL = 3e-5  # relative to each head's largest output, as tests/gpu/test_cuda.c
SAME = 1e-6  # the same kernels on the same data (split reductions may sum in another order)


def test_the_library_has_the_cuda_backend():
    import ctypes

    from entmaxkv import _lib

    n = ctypes.c_int32()
    ctx = _lib.context()
    ctx.call(_lib.lib.ekv_cuda_device_count, ctx.ptr, ctypes.byref(n))
    assert n.value >= 1, "libentmaxkv was built without CUDA (pip install . with EKV_CUDA=ON)"


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    scale = np.maximum(np.abs(ref).max(axis=-1, keepdims=True), 1e-6)
    return float((np.abs(out - ref) / scale).max())


def make_kv(lens, seed):
    g = torch.Generator().manual_seed(seed)
    kvs = []
    for n in lens:
        k = torch.randn(n, HK, D, generator=g)
        hit = torch.rand(n, generator=g) < 0.03
        k[hit] += 2.5 * torch.randn(D, generator=g)  # a few keys stand out: sparse supports
        kvs.append((k, torch.randn(n, HK, D, generator=g)))
    return kvs


def fill(cache, kvs, device=None):
    seqs = []
    for k, v in kvs:
        s = cache.new_sequence()
        cache.append(s, k.to(device) if device else k, v.to(device) if device else v)
        seqs.append(s)
    return seqs


def both_caches(lens, dtype="float16", code_bits=4, layout="HND", seed=0):
    kvs = make_kv(lens, seed)
    gpu = entmaxkv.CudaPagedKVCache(num_pages=256, page_size=PS, num_kv_heads=HK, head_dim=D,
                                    dtype=dtype, code_bits=code_bits, layout=layout)
    cpu = entmaxkv.PagedKVCache(num_pages=256, page_size=PS, num_kv_heads=HK, head_dim=D,
                                dtype=dtype, code_bits=code_bits, superpage_pages=0)
    return gpu, fill(gpu, kvs, DEV), cpu, fill(cpu, kvs), kvs


def stored(x, dtype):
    """The float64 values of x as the cache stores them."""
    t = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    return x.to(t).double().numpy()


@pytest.mark.parametrize("alpha", [1.0, 1.5, 2.0])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_dense_against_float64_reference(alpha, dtype, layout):
    gpu, gs, _, _, kvs = both_caches([300, 77, 16], dtype=dtype, code_bits=0, layout=layout)
    slopes = np.array([2.0 ** -(h + 1) if h < H // 2 else 0.0 for h in range(H)], np.float32)
    q = torch.randn(3, H, D, generator=torch.Generator().manual_seed(9))
    for sl in (None, slopes):
        w = entmaxkv.DecodeWrapper("dense", alpha=alpha, alibi_slopes=sl)
        w.plan(gpu, gs, H)
        out = w.run(q.to(DEV))
        assert out.device == DEV and out.dtype == torch.float32
        for b, (k, v) in enumerate(kvs):
            ref = attention_ref(q[b].double().numpy(), stored(k, dtype), stored(v, dtype), alpha,
                                slopes=None if sl is None else sl.astype(np.float64))
            assert rel_err(out[b].cpu(), ref) < TOL, (alpha, dtype, layout, sl is not None, b)


@pytest.mark.parametrize("method", ["dense", "certified", "screened", "topk", "gaussian"])
def test_every_method_against_the_cpu_path(method):
    gpu, gs, cpu, cs, _ = both_caches([500, 129])
    q = torch.randn(2, H, D, generator=torch.Generator().manual_seed(5))
    outs, reports = [], []
    for cache, seqs, qq in ((gpu, gs, q.to(DEV)), (cpu, cs, q)):
        w = entmaxkv.DecodeWrapper(method, budget=0.25)
        w.plan(cache, seqs, H)
        outs.append(torch.as_tensor(w.run(qq)).cpu())
        reports.append(w.report)
    assert rel_err(outs[0], outs[1]) < TOL, method
    if method in ("dense", "certified", "screened"):  # exact: the dense support
        np.testing.assert_array_equal(reports[0]["support"], reports[1]["support"])
    np.testing.assert_allclose(reports[0]["tau"], reports[1]["tau"], rtol=1e-5, atol=1e-6)
    if method == "screened":
        assert reports[0]["survivors"] > 0


def test_topk_over_every_token_is_dense_and_out_is_written_in_place():
    gpu, gs, _, _, _ = both_caches([200])
    q = torch.randn(1, H, D, device=DEV)
    dense, topk = entmaxkv.DecodeWrapper("dense"), entmaxkv.DecodeWrapper("topk", budget=1.0)
    dense.plan(gpu, gs, H)
    topk.plan(gpu, gs, H)
    out = torch.zeros(1, H, D, device=DEV)
    assert topk.run(q, out=out) is out
    assert rel_err(out.cpu(), dense.run(q).cpu()) < TOL


def test_appends_and_steps_on_a_side_stream():
    """Appends and decode on the caller's stream (not the default one) give the results of
    the default stream."""
    kvs = make_kv([333], 3)
    q = torch.randn(1, H, D, device=DEV)
    results = []
    for stream in (torch.cuda.current_stream(), torch.cuda.Stream()):
        with torch.cuda.stream(stream):
            cache = entmaxkv.CudaPagedKVCache(num_pages=64, page_size=PS, num_kv_heads=HK,
                                              head_dim=D, code_bits=8)
            seqs = fill(cache, kvs, DEV)
            w = entmaxkv.DecodeWrapper("screened")
            w.plan(cache, seqs, H)
            results.append(w.run(q).cpu())
        torch.cuda.synchronize()
    assert rel_err(results[0], results[1]) < SAME


@pytest.mark.parametrize("method", ["dense", "topk", "certified", "screened"])
def test_graph_replay_equals_eager(method):
    """A step captured once replays, after appends and a re-plan within max_pages_per_seq,
    to the eager result over the new lengths."""
    gpu, gs, _, _, _ = both_caches([300, 130])
    s = torch.cuda.Stream()
    q = torch.randn(2, H, D, device=DEV)
    out = torch.zeros(2, H, D, device=DEV)
    w = entmaxkv.DecodeWrapper(method, budget=0.25)
    s.wait_stream(torch.cuda.current_stream())  # the appends ran on the default stream
    with torch.cuda.stream(s):
        w.plan(gpu, gs, H, max_pages_per_seq=64)
        w.run(q, out)  # warm-up outside the capture
    s.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        w.run(q, out)
    step = w._cuda
    g = torch.Generator().manual_seed(1)
    for grow in (1, 40):
        with torch.cuda.stream(s):
            for seq in gs:
                gpu.append(seq, torch.randn(grow, HK, D, generator=g).to(DEV),
                           torch.randn(grow, HK, D, generator=g).to(DEV))
            w.plan(gpu, gs, H, max_pages_per_seq=64)
            assert w._cuda is step  # the same C plan and device table: the graph is valid
            q.copy_(torch.randn(2, H, D, generator=g))
            graph.replay()
            replayed = out.clone()
            eager = w.run(q)
        s.synchronize()
        assert rel_err(replayed.cpu(), eager.cpu()) < SAME, (method, grow)
        assert w.report["support"].shape == (2, H)


def test_compiled_call_equals_eager():
    gpu, gs, _, _, _ = both_caches([250])
    w = entmaxkv.DecodeWrapper("certified", budget=0.25)
    w.plan(gpu, gs, H)

    def f(q):
        return w.run(q * 0.5) + 1.0

    q = torch.randn(1, H, D, device=DEV)
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(q)
    assert rel_err(compiled.cpu(), f(q).cpu()) < SAME


def test_adopt_pages_written_by_another_engine():
    kp = torch.zeros(32, PS, HK, D, dtype=torch.float16, device=DEV)
    vp = torch.zeros_like(kp)
    cache = entmaxkv.PagedKVCache.wrap(kp, vp, layout="NHD", code_bits=8)
    assert isinstance(cache, entmaxkv.CudaPagedKVCache)
    n, pages = 40, [7, 3, 20]
    k = torch.randn(n, HK, D, device=DEV)
    v = torch.randn(n, HK, D, device=DEV)
    for t in range(n):
        kp[pages[t // PS], t % PS], vp[pages[t // PS], t % PS] = k[t].half(), v[t].half()
    seq = cache.adopt(pages, last_page_len=8)
    assert cache.length(seq) == n and cache.free_pages == 29
    own = entmaxkv.CudaPagedKVCache(num_pages=32, page_size=PS, num_kv_heads=HK, head_dim=D,
                                    code_bits=8)
    so = own.new_sequence()
    own.append(so, k.half().float(), v.half().float())
    q = torch.randn(1, H, D, device=DEV)
    for method in ("dense", "screened", "certified"):
        a, b = entmaxkv.DecodeWrapper(method), entmaxkv.DecodeWrapper(method)
        a.plan(cache, [seq], H)
        b.plan(own, [so], H)
        assert rel_err(a.run(q).cpu(), b.run(q).cpu()) < SAME, method
    with pytest.raises(entmaxkv.EntmaxKVError, match="another sequence"):
        cache.adopt([3], last_page_len=1)
    kp[0, 0, 0, 0] = float("nan")
    with pytest.raises(entmaxkv.EntmaxKVError, match="NaN"):
        cache.adopt([0], last_page_len=1)
    assert cache.free_pages == 29


def test_run_errors():
    gpu, gs, _, _, _ = both_caches([40])
    w = entmaxkv.DecodeWrapper("dense")
    w.plan(gpu, gs, H)
    q = torch.randn(1, H, D, device=DEV)
    with pytest.raises(TypeError, match="CUDA tensor"):
        w.run(q.cpu())
    with pytest.raises(TypeError, match="torch.float32"):
        w.run(q.half())
    with pytest.raises(ValueError, match=r"\[1, 8, 64\]"):
        w.run(torch.randn(1, H, D + 8, device=DEV))
    with pytest.raises(ValueError, match="contiguous"):
        w.run(torch.randn(1, D, H, device=DEV).transpose(1, 2))
    with pytest.raises(ValueError, match="contiguous"):
        w.run(q, out=torch.empty(1, D, H, device=DEV).transpose(1, 2))
    with torch.cuda.stream(torch.cuda.Stream()):
        with pytest.raises(RuntimeError, match="stream"):
            w.run(q)
    with pytest.raises(TypeError, match="CUDA tensor"):
        w.run(q.cpu().numpy())
    host = entmaxkv.PagedKVCache(num_pages=8, page_size=PS, num_kv_heads=HK, head_dim=D)
    hs = host.new_sequence()
    host.append(hs, np.ones((5, HK, D), np.float32), np.ones((5, HK, D), np.float32))
    hw = entmaxkv.DecodeWrapper("dense")
    hw.plan(host, [hs], H)
    with pytest.raises(TypeError, match="host memory"):
        hw.run(q)
    with pytest.raises(TypeError, match="host memory"):
        host.append(hs, q[0, :HK], q[0, :HK])
    with pytest.raises(ValueError, match="max_pages_per_seq"):
        w.plan(gpu, gs, H, max_pages_per_seq=1)
    gpu.append(gs[0], torch.zeros(1, HK, D, device=DEV), torch.zeros(1, HK, D, device=DEV))
    with pytest.raises(RuntimeError, match="changed since plan"):
        w.run(q)
    no_codes = entmaxkv.CudaPagedKVCache(num_pages=8, page_size=PS, num_kv_heads=HK, head_dim=D)
    s = no_codes.new_sequence()
    no_codes.append(s, torch.randn(20, HK, D, device=DEV), torch.randn(20, HK, D, device=DEV))
    scr = entmaxkv.DecodeWrapper("screened")
    scr.plan(no_codes, [s], H)
    with pytest.raises(entmaxkv.EntmaxKVError, match="key codes"):
        scr.run(q)
    ga = entmaxkv.DecodeWrapper("gaussian", alibi_slopes=np.ones(H, np.float32))
    ga.plan(no_codes, [s], H)
    assert torch.isfinite(ga.run(q)).all()  # the ALiBi mixture runs on the GPU (no refusal)


def test_cache_errors_change_nothing():
    cache = entmaxkv.CudaPagedKVCache(num_pages=4, page_size=PS, num_kv_heads=HK, head_dim=D)
    s = cache.new_sequence()
    cache.append(s, torch.ones(10, HK, D, device=DEV), torch.ones(10, HK, D, device=DEV))
    before = cache.k.clone()
    bad = torch.ones(3, HK, D, device=DEV)
    bad[1, 0, 0] = float("inf")
    with pytest.raises(entmaxkv.EntmaxKVError, match="NaN or infinite"):
        cache.append(s, bad, bad)
    with pytest.raises(entmaxkv.EntmaxKVError, match="free pages"):
        cache.append(s, torch.ones(60, HK, D, device=DEV), torch.ones(60, HK, D, device=DEV))
    assert cache.length(s) == 10 and cache.free_pages == 3
    torch.testing.assert_close(cache.k, before, rtol=0, atol=0)
    with pytest.raises(TypeError, match="CUDA tensor"):
        cache.append(s, torch.ones(1, HK, D), torch.ones(1, HK, D))
    with pytest.raises(TypeError, match="float32"):
        cache.append(s, torch.ones(1, HK, D, device=DEV).half(), torch.ones(1, HK, D, device=DEV).half())
    with pytest.raises(ValueError, match=r"\[tokens, 2, 64\]"):
        cache.append(s, torch.ones(1, HK + 1, D, device=DEV), torch.ones(1, HK + 1, D, device=DEV))
    with pytest.raises(entmaxkv.EntmaxKVError, match="sequence"):
        cache.length(99)
    with pytest.raises(ValueError, match="multiple of 8"):
        entmaxkv.CudaPagedKVCache(num_pages=4, head_dim=12)
    with pytest.raises(ValueError, match="dtype"):
        entmaxkv.CudaPagedKVCache(num_pages=4, dtype="int8")
    k = torch.zeros(4, HK, PS, D, dtype=torch.float16, device=DEV)
    with pytest.raises(ValueError, match="contiguous"):
        entmaxkv.PagedKVCache.wrap(k.transpose(1, 2), k.transpose(1, 2))
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        entmaxkv.CudaPagedKVCache.wrap(k.to(torch.int16), k.to(torch.int16))


def test_the_shipped_model_decodes_on_cuda_as_on_the_cpu():
    """The transformers integration with CUDA tensors: EntmaxKVCache over CudaPagedKVCache
    layers gives the CPU dense forward's greedy tokens and, within float32 rounding across
    devices, its logits (the prefill's dense entmax on CUDA is the entmax package's)."""
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    pytest.importorskip("entmax")
    import pathlib

    from entmaxkv.hf import EntmaxKVCache
    from entmaxkv.hf_lm import EntmaxKVLM

    path = pathlib.Path(__file__).resolve().parents[2] / "models" / "entmaxkv-lm.safetensors"
    x = torch.tensor([list(b"The pass key is 12345. Remember it. What is the pass key? The pass key is ")])
    runs = []
    for device, impl in (("cpu", "eager"), ("cuda", "entmaxkv")):
        model = EntmaxKVLM.from_safetensors(path, attn_implementation=impl).to(device)
        cache = EntmaxKVCache(model.config.n_layers, num_pages=64, dtype="float32",
                              method="certified") if impl == "entmaxkv" else None
        with torch.no_grad():
            out = model.generate(x.to(device), cache=cache, max_new_tokens=8, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        runs.append((out.sequences.cpu(), torch.stack(out.logits, 1).cpu()))
        if cache is not None:
            assert isinstance(cache.layers[0].cache, entmaxkv.CudaPagedKVCache)
    assert runs[0][0].tolist() == runs[1][0].tolist()
    torch.testing.assert_close(runs[1][1], runs[0][1], rtol=0, atol=2e-3)
