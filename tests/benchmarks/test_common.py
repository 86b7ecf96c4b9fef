"""benchmarks/common.py: the results CSVs every benchmark appends to, and the one check of the GPU benchmarks
for a CUDA GPU."""
import csv
import importlib
import os

import pytest

import common

TEXT = """GPU X, torch 2
## GEMM: INT8 vs BF16

| model | GEMM | speedup |
|---|---|---|
| Llama2-7B | fc1 | 2.10x |
| Qwen3-4B | fc2 | 1.95x |

note between tables
| shape | ms |
|:--|--:|
| a | 0.5 |
"""


def test_markdown_tables_are_parsed_with_their_titles():
    tables = common.markdown_tables(TEXT)
    assert [t for t, _ in tables] == ["GEMM: INT8 vs BF16", "note between tables"]
    assert tables[0][1] == [{"model": "Llama2-7B", "GEMM": "fc1", "speedup": "2.10x"},
                            {"model": "Qwen3-4B", "GEMM": "fc2", "speedup": "1.95x"}]
    assert tables[1][1] == [{"shape": "a", "ms": "0.5"}]


def test_record_tables_appends_rows_with_their_provenance(tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    paths = common.record_tables("kernels", TEXT, directory=str(tmp_path))
    common.record_tables("kernels", TEXT, directory=str(tmp_path))  # a second run appends
    assert [p.rsplit("/", 1)[1] for p in paths] == ["kernels_gemm_int8_vs_bf16.csv", "kernels_note_between_tables.csv"]
    with open(paths[0], newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and rows[2]["model"] == "Llama2-7B" and rows[0]["table"] == "GEMM: INT8 vs BF16"
    assert list(rows[0])[:6] == list(common.PROVENANCE)
    assert rows[0]["gpu"] and rows[0]["torch"] and rows[0]["date"].count("-") == 2 and rows[0]["commit"]


def test_a_changed_layout_is_refused_instead_of_mixed(tmp_path):
    common.append_results("x", [{"a": 1}], directory=str(tmp_path))
    with pytest.raises(ValueError, match="columns"):
        common.append_results("x", [{"a": 1, "b": 2}], directory=str(tmp_path))


def test_rows_go_to_out_on_the_gpu_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    path = common.append_results("e2e", [{"model": "m", "int8_tok_s": 1.5}])
    assert path == str(tmp_path / "e2e.csv")


def test_smoke_rows_go_only_where_asked(tmp_path, monkeypatch):
    """benchmarks/results holds GPU measurements: a smoke run's rows, or any where CUDA is missing, go only to a
    directory given or $OUT, never to the committed CSVs."""
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setattr(common, "RESULTS", str(tmp_path / "results"))
    monkeypatch.setattr(common.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(common.torch.cuda, "get_device_name", lambda *a: "GPU X")
    assert common.append_results("x", [{"a": 1}], smoke=True) == ""
    assert common.record_tables("x", TEXT, smoke=True) == ["", ""]
    assert not (tmp_path / "results").exists()
    assert common.append_results("x", [{"a": 1}]) == str(tmp_path / "results" / "x.csv")  # a GPU measurement
    monkeypatch.setattr(common.torch.cuda, "is_available", lambda: False)
    assert common.append_results("cpu", [{"a": 1}]) == ""
    assert common.append_results("cpu", [{"a": 1}], directory=str(tmp_path), smoke=True) == str(tmp_path / "cpu.csv")
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    assert common.append_results("cpu", [{"a": 1}], smoke=True) == str(tmp_path / "out" / "cpu.csv")
    assert sorted(os.listdir(tmp_path / "results")) == ["x.csv"]


def test_a_repeated_header_cell_keeps_both_values():
    (_, rows), = common.markdown_tables("| x | ms | y | ms |\n|---|---|---|---|\n| a | 1 | b | 2 |\n")
    assert rows == [{"x": "a", "ms": "1", "y": "b", "ms (2)": "2"}]


def test_the_command_names_the_settings_that_change_what_runs(monkeypatch):
    for name in [k for k in os.environ if k.startswith("MEGATRON_INT8_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("MEGATRON_INT8_GEMM_KERNEL", "portable")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("HOME", "/elsewhere")  # not recorded
    command = common.provenance()["command"]
    assert command.startswith("MEGATRON_INT8_GEMM_KERNEL=portable PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                              "python3 ")
    assert "HOME" not in command


@pytest.mark.parametrize("script", ["bench_attention", "bench_kernels", "bench_compile_layer", "bench_hf_llama",
                                    "bench_moe_gemm", "bench_norm", "bench_optimizer", "bench_rope",
                                    "bench_shape_policy"])
def test_a_gpu_benchmark_without_cuda_says_so_in_one_line(monkeypatch, script):
    monkeypatch.setattr(common.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match=f"^{script}.py needs a CUDA GPU$"):
        importlib.import_module(script).main([])
