"""``prhs-eval table5`` (end-to-end decode throughput) and the table folders it writes, on the
tiny shape on the CPU (the H200 figures are in docs/results/table5/)."""

from __future__ import annotations

import json

import pytest
import torch

from prhs_core.registry import UnknownSelectorError
from prhs_eval.cli import main
from prhs_eval.tables import markdown_table, rst_table, write_table_folder
from prhs_eval.throughput import (
    Method,
    ThroughputPoint,
    compiled_parts,
    fused_projections,
    kv_bytes_per_token,
    load_points,
    model_config,
    parse_methods,
    random_model,
    weight_bytes,
)

TINY = ["--shapes", "tiny", "--batches", "2", "--contexts", "256", "--headroom", "20",
        "--dtype", "float32", "--device", "cpu", "--quiet", "--set", "budget=32"]  # fmt: skip


def test_parse_methods_brackets_common_options_and_errors():
    got = parse_methods("sdpa, dense,prhs[tau=0.5;rescore=0],quest", {"budget": 64})
    assert got == [
        Method("sdpa"),
        Method("dense"),
        Method("prhs", {"budget": 64, "tau": 0.5, "rescore": 0}),
        Method("quest", {"budget": 64}),
    ]
    assert got[2].label == "prhs[budget=64;tau=0.5;rescore=0]"
    with pytest.raises(ValueError, match="has no option 'nope'"):
        parse_methods("prhs[nope=1]")
    with pytest.raises(ValueError, match="sdpa has no option"):
        parse_methods("sdpa[budget=4]")
    with pytest.raises(ValueError, match="given twice"):
        parse_methods("dense,dense")
    with pytest.raises(UnknownSelectorError):
        parse_methods("fast")
    with pytest.raises(ValueError):  # a bad value fails at parse time, not on the GPU
        parse_methods("cis[budget=-3]")


def test_byte_counts_of_the_published_shapes():
    cfg = model_config("llama2-7b")
    assert kv_bytes_per_token(cfg, torch.bfloat16) == 2 * 32 * 32 * 128 * 2  # 512 KiB
    cfg3 = model_config("llama3-8b")
    assert kv_bytes_per_token(cfg3, torch.bfloat16) == 2 * 32 * 8 * 128 * 2  # GQA: 128 KiB
    model = random_model(cfg, "meta", torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    assert params == 6_738_415_616  # Llama-2-7B's parameter count
    emb = 32000 * 4096
    assert weight_bytes(model, 8) == (params - emb) * 2 + 8 * 4096 * 2


def test_table5_writes_its_folder_and_joins_runs(tmp_path):
    out = tmp_path / "results"
    code = main(["table5", *TINY, "--methods", "sdpa,dense,oracle", "--out", str(out)])
    assert code == 0
    folder = out / "table5"
    names = {p.name for p in folder.iterdir()}
    assert names == {"README.md", "table.rst", "rows.jsonl", "config.json", "machine.json",
                     "table5.png"}  # fmt: skip
    rows = [json.loads(x) for x in (folder / "rows.jsonl").read_text().splitlines()]
    assert [r["method"] for r in rows] == ["sdpa", "dense", "oracle[budget=32]"]
    for r in rows:
        assert r["ms_per_step"] > 0 and r["floor_ms"] > 0
        assert r["vs_floor"] == pytest.approx(r["ms_per_step"] / r["floor_ms"])
        assert r["graph"] is False  # no CUDA here: eager, and the README says so
    dense, oracle = rows[1], rows[2]
    assert oracle["retrieval_ratio"] == 100.0
    assert oracle["kv_bytes_per_step"] < dense["kv_bytes_per_step"]  # reads fewer positions
    readme = (folder / "README.md").read_text()
    assert "| tiny | 2 | 256 | oracle[budget=32] |" in readme and "not a throughput" in readme
    assert "list-table" in (folder / "table.rst").read_text()
    config = json.loads((folder / "config.json").read_text())
    assert config["methods"] == ["sdpa", "dense", "oracle[budget=32]"]
    assert config["runs"][0]["shape"] == "tiny"

    # A later folder's measured point replaces an earlier skipped one.
    second = tmp_path / "second"
    second.mkdir()
    skipped = [dict(r, ms_per_step=None, skipped="out of memory") for r in rows]
    with open(second / "rows.jsonl", "w") as f:
        for r in skipped:
            f.write(json.dumps(r) + "\n")
    for name in ("config.json", "machine.json"):
        (second / name).write_text((folder / name).read_text())
    joined = tmp_path / "joined"
    code = main(["table5", "--from-rows", f"{second},{folder}", "--out", str(joined)])
    assert code == 0
    again = [json.loads(x) for x in (joined / "table5" / "rows.jsonl").read_text().splitlines()]
    assert all(r["skipped"] is None for r in again) and len(again) == 3
    points, runs, machine = load_points([folder])
    assert all(isinstance(p, ThroughputPoint) for p in points) and runs and machine


def test_compiled_parts_compile_norms_mlps_and_rotary_then_restore():
    import torch._dynamo
    from transformers.models.llama import modeling_llama

    model = random_model(model_config("tiny"), "cpu", torch.float32)
    ids = torch.randint(0, 512, (2, 5))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    rotary = modeling_llama.apply_rotary_pos_emb
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.reset()
    counts = torch._dynamo.utils.counters
    counts.clear()
    with compiled_parts(model, "eager") as n:
        assert n == 2 * 2 + 1 + 2  # two layers' norms (2 each) and the final one; two MLPs
        assert modeling_llama.apply_rotary_pos_emb is not rotary
        with torch.no_grad():
            got = model(input_ids=ids).logits
        # Dynamo captured frames: the compiled norms, MLPs and rotary ran.
        assert counts["stats"]["unique_graphs"] >= 3
    torch.testing.assert_close(got, want)
    assert modeling_llama.apply_rotary_pos_emb is rotary
    assert torch._dynamo.config.recompile_limit == limit
    assert all(getattr(m, "_compiled_call_impl", None) is None for m in model.modules())
    with pytest.raises(ValueError, match="no module whose class name"):
        with compiled_parts(torch.nn.Linear(2, 2)):
            pass


def test_compiled_layers_trace_each_layer_but_not_prhs_attention():
    import torch._dynamo

    from prhs_eval.integration import enable
    from prhs_eval.throughput import _fill, _static_cache

    model = random_model(model_config("tiny"), "cpu", torch.float32)
    cache = _static_cache(model, 2, 64, torch.device("cpu"))
    _fill(cache, 40, 0)
    tokens = torch.zeros(2, 1, dtype=torch.long)

    def decode(steps: int = 3) -> torch.Tensor:
        _fill(cache, 40, 0)
        rt = enable(model, "prhs", max_seq_len=64, checked=False, budget=16, block_size=8)
        rt.attach(cache, 2)
        out = []
        with torch.no_grad():
            for _ in range(steps):
                out.append(model(input_ids=tokens, past_key_values=cache).logits[:, -1])
        rt.disable()
        return torch.stack(out)

    want = decode()
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.reset()
    counts = torch._dynamo.utils.counters
    counts.clear()
    with compiled_parts(model, "eager", scope="layers") as n:
        assert n == 4  # the two decoder layers, the rotary embedding and the final norm
        assert torch._dynamo.config.recompile_limit >= 64
        got = decode()
        # Each layer compiled (a graph per layer index), broken at prhs's attention call.
        assert counts["stats"]["unique_graphs"] >= 2
        breaks = " ".join(counts["graph_break"])
        assert "torch.compiler.disable" in breaks and "_prhs_attention" in breaks
    torch.testing.assert_close(got, want)
    assert torch._dynamo.config.recompile_limit == limit
    assert all(getattr(m, "_compiled_call_impl", None) is None for m in model.modules())
    with pytest.raises(ValueError, match="scope must be one of"):
        with compiled_parts(model, "eager", scope="model"):
            pass
    assert all(getattr(m, "_compiled_call_impl", None) is None for m in model.modules())


def test_table5_compile_scope_layers_marks_and_keeps_its_rows(tmp_path):
    out = tmp_path / "layers"
    argv = ["table5", *TINY, "--methods", "sdpa,prhs", "--compile", "eager",
            "--compile-scope", "layers", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = [json.loads(x) for x in (out / "table5" / "rows.jsonl").read_text().splitlines()]
    assert [(r["compiled"], r["compile_scope"]) for r in rows] == [("eager", "layers")] * 2
    assert (
        "| tiny | 2 | 256 | sdpa · compiled layers |" in (out / "table5" / "README.md").read_text()
    )
    config = json.loads((out / "table5" / "config.json").read_text())
    assert config["runs"][0]["compile_scope"] == "layers"
    parts = tmp_path / "parts"
    assert (
        main(["table5", *TINY, "--methods", "sdpa", "--compile", "eager", "--out", str(parts)]) == 0
    )
    points, _, _ = load_points([out / "table5", parts / "table5"])
    assert sorted((p.method, str(p.compile_scope)) for p in points) == [
        ("prhs[budget=32]", "layers"), ("sdpa", "layers"), ("sdpa", "parts")]  # fmt: skip


def test_fused_projections_run_one_gemm_each_and_compute_what_the_model_did(monkeypatch):
    import torch.nn.functional as F

    model = random_model(model_config("tiny"), "cpu", torch.float32)
    ids = torch.randint(0, 512, (2, 5))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    params = sum(p.numel() for p in model.parameters())
    attn = model.model.layers[0].self_attn
    mlp = model.model.layers[0].mlp
    widths = []
    real_linear = F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: widths.append(w.shape[0])
                        or real_linear(x, w, b))  # fmt: skip
    with fused_projections(model) as (n_attn, n_mlp):
        assert (n_attn, n_mlp) == (2, 2)
        # Each projection's weight is a view of one concatenation: no second copy.
        assert attn.k_proj.weight.data_ptr() == attn.q_proj.weight.data_ptr() + (
            attn.q_proj.weight.numel() * attn.q_proj.weight.element_size()
        )
        assert mlp.up_proj.weight.data_ptr() > mlp.gate_proj.weight.data_ptr()
        assert sum(p.numel() for p in model.parameters()) == params
        with torch.no_grad():
            got = model(input_ids=ids).logits
        cfg = model.config
        hd = cfg.hidden_size // cfg.num_attention_heads
        qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd
        # Per layer: one q/k/v GEMM, o, one gate/up GEMM, down; then the LM head.
        layer = [qkv, cfg.hidden_size, 2 * cfg.intermediate_size, cfg.hidden_size]
        assert widths == layer * cfg.num_hidden_layers + [cfg.vocab_size]
        # k/v called on another input than q's run their own slice (unfused, correct).
        x = torch.randn(1, 3, cfg.hidden_size)
        with torch.no_grad():
            attn.q_proj(torch.randn(1, 3, cfg.hidden_size))
            torch.testing.assert_close(attn.k_proj(x), real_linear(x, attn.k_proj.weight))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert all("forward" not in m.__dict__ for m in model.modules())  # restored
    widths.clear()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-4, atol=1e-5)
    assert len(widths) == 7 * cfg.num_hidden_layers + 1  # the separate projections again
    with pytest.raises(ValueError, match="no q/k/v or gate/up projections"):
        with fused_projections(torch.nn.Linear(2, 2)):
            pass


def test_decode_gemms_route_every_linear_and_the_fused_ones_through_prhs(monkeypatch):
    import prhs_kernels.gemm
    from prhs_eval.throughput import decode_gemms

    model = random_model(model_config("tiny"), "cpu", torch.float32)
    ids = torch.randint(0, 512, (2, 1))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    widths: list[int] = []
    real = prhs_kernels.gemm.decode_linear

    def counted(x, weight, bias=None):
        widths.append(weight.shape[0])
        return real(x, weight, bias)

    monkeypatch.setattr(prhs_kernels.gemm, "decode_linear", counted)
    cfg = model.config
    qkv = cfg.hidden_size + 2 * cfg.num_key_value_heads * (
        cfg.hidden_size // cfg.num_attention_heads
    )
    for fuse, per_layer in ((False, 7), (True, 4)):
        widths.clear()
        with decode_gemms(model, fuse=fuse) as n, torch.no_grad():
            # Every Linear but the fused q/k/v (their forwards are the fused GEMM's), LM head too.
            assert n == (4 if fuse else 7) * 2 + 1
            got = model(input_ids=ids).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert len(widths) == per_layer * 2 + 1 and widths[-1] == cfg.vocab_size
        if fuse:  # one q/k/v GEMM and one gate|up GEMM per layer
            assert widths[:4] == [qkv, cfg.hidden_size, 2 * cfg.intermediate_size,
                                  cfg.hidden_size]  # fmt: skip
    assert all("forward" not in m.__dict__ for m in model.modules())
    with pytest.raises(ValueError, match="no nn\\.Linear"):
        with decode_gemms(torch.nn.ReLU()):
            pass


def test_table5_gemm_triton_marks_its_rows(tmp_path):
    out = tmp_path / "r"
    argv = ["table5", *TINY, "--methods", "sdpa,prhs", "--gemm", "triton", "--out", str(out)]
    assert main(argv) == 0
    rows = [json.loads(x) for x in (out / "table5" / "rows.jsonl").read_text().splitlines()]
    assert [r["gemm"] for r in rows] == ["triton", "triton"]
    readme = (out / "table5" / "README.md").read_text()
    assert "| tiny | 2 | 256 | sdpa · triton GEMMs |" in readme and "prhs_kernels.gemm" in readme
    cublas = tmp_path / "c"
    assert main(["table5", *TINY, "--methods", "sdpa", "--out", str(cublas)]) == 0
    points, _, _ = load_points([out / "table5", cublas / "table5"])
    assert sorted((p.method, str(p.gemm)) for p in points) == [
        ("prhs[budget=32]", "triton"), ("sdpa", "None"), ("sdpa", "triton")]  # fmt: skip


def test_table5_fuse_marks_its_rows(tmp_path):
    out = tmp_path / "results"
    assert main(["table5", *TINY, "--methods", "sdpa,oracle", "--fuse", "--out", str(out)]) == 0
    rows = [json.loads(x) for x in (out / "table5" / "rows.jsonl").read_text().splitlines()]
    assert [r["fused"] for r in rows] == [True, True]
    readme = (out / "table5" / "README.md").read_text()
    assert "| sdpa · fused |" in readme and "`· fused`" in readme


def test_table5_fuse_layers_marks_and_keeps_its_rows(tmp_path, monkeypatch):
    import prhs_kernels.gemm

    ran = []
    real = prhs_kernels.gemm.decode_linear_swiglu
    monkeypatch.setattr(prhs_kernels.gemm, "decode_linear_swiglu",
                        lambda *a, **kw: ran.append(1) or real(*a, **kw))  # fmt: skip
    out = tmp_path / "layers"
    argv = ["table5", *TINY, "--methods", "sdpa", "--gemm", "triton", "--fuse-layers",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert ran  # the timed steps ran the layers' epilogue GEMMs
    layers = out / "table5"
    rows = [json.loads(x) for x in (layers / "rows.jsonl").read_text().splitlines()]
    assert [(r["fused"], r["fused_layers"], r["rope_epilogue"], r["gemm"]) for r in rows] == [
        (True, True, True, "triton")]  # fmt: skip
    readme = (layers / "README.md").read_text()
    assert "| tiny | 2 | 256 | sdpa · fused layers + rope · triton GEMMs |" in readme
    assert "`· fused layers`" in readme and "`+ rope`" in readme
    run = json.loads((layers / "config.json").read_text())["runs"][0]
    assert (run["fuse"], run["fuse_layers"], run["gemm"]) == (True, True, "triton")

    # The same point run with --fuse alone is another row; one written before fused_layers
    # existed reads as that (and, later, replaces it).
    def folder(name: str, row: dict) -> str:
        path = tmp_path / name
        path.mkdir()
        (path / "rows.jsonl").write_text(json.dumps(row) + "\n")
        for f in ("config.json", "machine.json"):
            (path / f).write_text((layers / f).read_text())
        return str(path)

    fused = folder("fused", dict(rows[0], fused_layers=False, rope_epilogue=False,
                                 ms_per_step=1.0))  # fmt: skip
    older = {k: v for k, v in rows[0].items() if k not in ("fused_layers", "rope_epilogue")}
    old = folder("old", older | {"ms_per_step": 2.0})
    # Fused layers without the rotary epilogue, as rows were written before it existed.
    no_rope = folder("norope", {k: v for k, v in rows[0].items() if k != "rope_epilogue"}
                     | {"ms_per_step": 3.0})  # fmt: skip
    points, _, _ = load_points([layers, fused, old, no_rope])
    got = sorted((p.fused_layers, p.rope_epilogue, p.ms_per_step) for p in points)
    assert got == [(False, False, 2.0), (True, False, 3.0), (True, True, rows[0]["ms_per_step"])]
    joined = tmp_path / "joined"
    argv = ["table5", "--from-rows", f"{layers},{fused},{no_rope}", "--out", str(joined)]
    assert main(argv) == 0
    readme = (joined / "table5" / "README.md").read_text()
    assert "| sdpa · fused · triton GEMMs | 1.000 |" in readme
    assert "| sdpa · fused layers · triton GEMMs | 3.000 |" in readme
    assert "| sdpa · fused layers + rope · triton GEMMs |" in readme


def test_a_selector_is_timed_without_statistics_and_counted_in_a_second_run(monkeypatch):
    import prhs_eval.integration as integration
    from prhs_eval.throughput import decode_throughput

    calls = []
    real = integration.enable

    def spy(*args, **kw):
        calls.append(kw["stats"])
        return real(*args, **kw)

    monkeypatch.setattr(integration, "enable", spy)
    methods = parse_methods("sdpa,prhs[tau=-1.0]", {"budget": 32})
    points, _ = decode_throughput("tiny", [2], [256], methods, device="cpu",
                                  dtype=torch.float32, headroom=20)  # fmt: skip
    assert calls == [False, True]  # sdpa enables nothing
    prhs = points[1]
    assert prhs.retrieval_ratio is not None and 0 < prhs.retrieval_ratio < 100
    assert prhs.kv_bytes_per_step < points[0].kv_bytes_per_step


def test_table5_compile_runs_every_method_compiled(tmp_path):
    out = tmp_path / "results"
    argv = ["table5", *TINY, "--methods", "sdpa,prhs", "--compile", "eager", "--out", str(out)]
    assert main(argv) == 0
    rows = [json.loads(x) for x in (out / "table5" / "rows.jsonl").read_text().splitlines()]
    assert [r["compiled"] for r in rows] == ["eager", "eager"]
    assert all(r["ms_per_step"] > 0 for r in rows)
    readme = (out / "table5" / "README.md").read_text()
    assert "| tiny | 2 | 256 | sdpa · compiled |" in readme and "torch.compile" in readme
    config = json.loads((out / "table5" / "config.json").read_text())
    assert config["runs"][0]["compile"] == "eager"
    # Joined with an eager run of the same methods, both points of each method are kept.
    eager = tmp_path / "eager"
    assert main(["table5", *TINY, "--methods", "sdpa,prhs", "--out", str(eager)]) == 0
    points, _, _ = load_points([out / "table5", eager / "table5"])
    assert sorted((p.method, str(p.compiled)) for p in points) == [
        ("prhs[budget=32]", "None"), ("prhs[budget=32]", "eager"), ("sdpa", "None"),
        ("sdpa", "eager")]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--shapes", "gpt5"], "unknown ['gpt5']"),
        (["--methods", "prhs[budget=4096]", "--contexts", "1024"], "budget 4096 >= context 1024"),
        (["--methods", "dense[nope=1]"], "has no option 'nope'"),
        (["--set", "nope=2"], "no method"),
        (["--headroom", "8"], "at least 16"),
        (["--compile-scope", "model"], "invalid choice: 'model'"),
        (["--gemm", "cutlass"], "invalid choice: 'cutlass'"),
        (["--fuse-layers"], "--fuse-layers needs --gemm triton"),
        (["--fuse-layers", "--fuse", "--gemm", "cublas"], "--fuse-layers needs --gemm triton"),
        (["--device", "cuda:7"], "cuda"),
        (["--from-rows", "/nonexistent"], "no rows.jsonl"),
    ],
)
def test_table5_bad_arguments_exit_2_before_any_work(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(["table5", *argv, "--out", str(tmp_path / "r")])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_table_folder_is_replaced_whole_and_checked(tmp_path):
    common = dict(title="t", head=("a", "b"), records=[{"a": 1}], config={}, machine={})
    folder = write_table_folder(tmp_path, "table2", rows=[["1", "x|y"]], **common)
    (folder / "stale.txt").write_text("from an earlier run")
    write_table_folder(tmp_path, "table2", rows=[["2", "z"]], **common)
    assert not (folder / "stale.txt").exists()
    assert "| 2 | z |" in (folder / "README.md").read_text()
    with pytest.raises(ValueError, match="unknown table"):
        write_table_folder(tmp_path, "table99", rows=[["1", "2"]], **common)
    with pytest.raises(ValueError, match="header's 2 cells"):
        write_table_folder(tmp_path, "table2", rows=[["1"]], **common)
    with pytest.raises(ValueError, match="no rows"):
        write_table_folder(tmp_path, "table2", rows=[], **common)
    assert markdown_table(["h"], [["a|b"]]).splitlines()[2] == "| a\\|b |"
    assert rst_table(["h", "i"], [["1", ""]]).count("* -") == 2


def test_the_figure_keeps_one_bar_per_method_and_configuration(tmp_path, monkeypatch):
    import matplotlib.axes

    from prhs_eval.throughput import point_label, table5_figure

    base = dict(shape="tiny", batch=2, context=256, method="prhs", ms_per_step=1.0,
                tokens_per_s=2000.0, floor_ms=0.5)  # fmt: skip
    points = [
        ThroughputPoint(**base),
        ThroughputPoint(**base, compiled="inductor", fused=True),
        ThroughputPoint(
            **base, compiled="inductor", compile_scope="layers", fused=True, gemm="triton"
        ),
        ThroughputPoint(
            **base,
            compiled="inductor",
            compile_scope="layers",
            fused=True,
            fused_layers=True,
            gemm="triton",
        ),
        ThroughputPoint(**base, fused=True, fused_layers=True, rope_epilogue=True, gemm="triton"),
    ]
    labels = [point_label(p) for p in points]
    assert labels == ["prhs", "prhs · compiled · fused",
                      "prhs · compiled layers · fused · triton GEMMs",
                      "prhs · compiled layers · fused layers · triton GEMMs",
                      "prhs · fused layers + rope · triton GEMMs"]  # fmt: skip
    seen: list[str] = []
    real = matplotlib.axes.Axes.bar

    def bar(self, *args, **kwargs):
        seen.append(kwargs.get("label"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "bar", bar)
    table5_figure(points, tmp_path / "f.png")
    assert seen == labels and (tmp_path / "f.png").stat().st_size > 0


def test_rows_say_how_a_step_was_timed():
    """A CUDA row timed over the window shows its mean and its median step; a row timed by
    do_bench's median before the window existed says so; eager rows have no median."""
    from prhs_eval.throughput import TABLE5_HEAD, table5_rows

    base = dict(shape="tiny", batch=2, context=256, method="prhs", tokens_per_s=2000.0,
                floor_ms=0.5)  # fmt: skip
    window = ThroughputPoint(**base, ms_per_step=1.25, ms_median=1.0, graph=True)
    old = ThroughputPoint(**base, ms_per_step=1.0, graph=True)
    eager = ThroughputPoint(**base, ms_per_step=3.0)
    rows = table5_rows([window, old, eager])
    ms, median = TABLE5_HEAD.index("ms/step"), TABLE5_HEAD.index("median ms")
    assert [r[ms] for r in rows] == ["1.250", "1.000 (median)", "3.000"]
    assert [r[median] for r in rows] == ["1.000", "—", "—"]
    assert all(len(r) == len(TABLE5_HEAD) for r in rows)
    assert ThroughputPoint.from_dict(window.as_dict()) == window


def test_the_cpu_step_timer_has_no_median():
    from prhs_eval.throughput import _time_step

    calls = []
    ms, median, graphed = _time_step(lambda: calls.append(1), torch.device("cpu"), 5)
    assert ms >= 0 and median is None and graphed is False and len(calls) == 5
