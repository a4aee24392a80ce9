# SPDX-License-Identifier: Apache-2.0
"""run_accuracy_vllm's ``suite`` step on the CPU: the engines' command lines (what each
``run`` gets) and the refusal of a suite without its dense baseline."""

from __future__ import annotations

import pytest

from benchmarks.accuracy import run_accuracy_vllm as R


def _args(*extra: str):
    return R.build_parser().parse_args(
        ["suite", "--prompts", "p.json.gz", "--model", "m", "--out-dir", "/o", *extra]
    )


def _value(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_every_engine_gets_its_own_record_cache_and_fixed_kv_memory():
    commands = R.suite_commands(_args(), total_gib=90.0)
    assert list(commands) == ["dense", "moira", "moira_mvar"]
    caches = set()
    for name, (cmd, env) in commands.items():
        assert cmd[cmd.index("run") - 1].endswith("run_accuracy_vllm")
        assert _value(cmd, "--out") == f"/o/{name}.json"
        assert float(_value(cmd, "--kv-cache-memory-gib")) == 30.0
        assert int(_value(cmd, "--chunk-tokens")) == 800_000
        # three engines side by side: 0.3 of the GPU each, all three fit
        assert float(_value(cmd, "--gpu-memory-utilization")) == 0.3
        caches.add(env["VLLM_CACHE_ROOT"])
    assert len(caches) == 3
    assert _value(commands["dense"][0], "--backend") == "FLASH_ATTN"
    mvar = commands["moira_mvar"][0]
    assert _value(mvar, "--estimator") == "mvar" and "--no-fixed" in mvar
    # each command is one `run` the parser accepts as it stands
    for cmd, _ in commands.values():
        args = R.build_parser().parse_args(cmd[cmd.index("run") :])
        assert args.kv_cache_memory_gib == 30.0 and args.out.startswith("/o/")


def test_options_reach_every_engine():
    commands = R.suite_commands(
        _args(
            "--engines",
            "dense",
            "moira",
            "--contexts",
            "4096",
            "--budget-s",
            "300",
            "--resume",
            "--kv-cache-dtype",
            "fp8",
        )  # fmt: skip
    )
    assert list(commands) == ["dense", "moira"]
    for cmd, _ in commands.values():
        assert _value(cmd, "--contexts") == "4096"
        assert _value(cmd, "--budget-s") == "300.0"
        assert _value(cmd, "--kv-cache-dtype") == "fp8"
        assert "--resume" in cmd
        assert float(_value(cmd, "--gpu-memory-utilization")) == 0.45


def test_kv_memory_is_vllms_bytes_or_nothing():
    assert R._kv_memory_kwargs(0.0) == {}
    assert R._kv_memory_kwargs(1.5) == {"kv_cache_memory_bytes": 3 * 2**29}


def test_a_suite_without_dense_is_refused(tmp_path):
    args = R.build_parser().parse_args(
        [
            "suite",
            "--prompts",
            "p",
            "--model",
            "m",
            "--engines",
            "moira",
            "--out-dir",
            str(tmp_path),
        ]  # fmt: skip
    )
    with pytest.raises(SystemExit, match="must include dense"):
        R.suite(args)


def test_the_int4_engine_is_opt_in_and_sets_the_summary_dtype():
    commands = R.suite_commands(_args("--engines", "dense", "moira_int4"))
    int4 = commands["moira_int4"][0]
    assert _value(int4, "--summary-dtype") == "int4" and "--no-fixed" in int4
    assert R.build_parser().parse_args(int4[int4.index("run") :]).summary_dtype == "int4"
    assert "moira_int4" not in R.suite_commands(_args())


def test_four_engines_share_the_kv_cache_and_keep_their_chunks_within_it():
    engines = ("dense", "moira", "moira_mvar", "moira_int4")
    commands = R.suite_commands(_args("--engines", *engines), total_gib=90.0)
    for cmd, _ in commands.values():
        # 90 GiB of KV cache over four engines, the chunk scaled alike (3/4 of each)
        assert float(_value(cmd, "--kv-cache-memory-gib")) == 22.5
        assert int(_value(cmd, "--chunk-tokens")) == 600_000
        assert float(_value(cmd, "--gpu-memory-utilization")) == 0.23
    # given sizes win over the scaled defaults
    given = R.suite_commands(
        _args("--engines", *engines, "--kv-cache-memory-gib", "12", "--chunk-tokens", "1000"),
        total_gib=90.0,
    )
    for cmd, _ in given.values():
        assert _value(cmd, "--kv-cache-memory-gib") == "12.0"
        assert _value(cmd, "--chunk-tokens") == "1000"


def test_a_smaller_gpu_scales_the_caches_down():
    # an H100's 47 GiB for the caches: two engines 23.5 GiB each, the chunk alike
    commands = R.suite_commands(_args("--engines", "dense", "moira"), total_gib=47.0)
    for cmd, _ in commands.values():
        assert float(_value(cmd, "--kv-cache-memory-gib")) == 23.5
        assert int(_value(cmd, "--chunk-tokens")) == int(800_000 * 47.0 / 60.0)


def test_the_caches_are_sized_from_nvml_and_fall_back_to_the_h200s(monkeypatch):
    pynvml = pytest.importorskip("vllm.third_party.pynvml")
    info = type("Info", (), {"total": 80 * 2**30})()
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda index: index)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", lambda handle: info)
    assert R.suite_kv_total_gib() == 48.0  # 0.6 of an 80 GiB GPU
    info.total = 141 * 2**30
    assert R.suite_kv_total_gib() == 84.6  # an H200
    info.total = 192 * 2**30
    assert R.suite_kv_total_gib() == R.SUITE_KV_CACHE_GIB  # capped at 90 GiB

    def no_gpu():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_gpu)
    assert R.suite_kv_total_gib() == R.SUITE_KV_CACHE_GIB
