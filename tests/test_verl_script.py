"""configs/verl/klear_rl.sh's context check (issue 22 S5), run with bash on CPU: a fake checkpoint ``config.json``
and a ``python`` on PATH that runs the script's own Python but records, instead of running, verl's ``main_ppo``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "src" / "klear" / "configs" / "verl" / "klear_rl.sh"
RAISE = "+actor_rollout_ref.model.override_config.max_position_embeddings"
RAISE_VLLM = "+actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides.max_position_embeddings"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(tmp_path: Path, config: dict, **env: str) -> tuple[subprocess.CompletedProcess, dict[str, str] | None]:
    """Run the script on a checkpoint whose config.json is ``config``; returns the process and verl's overrides
    (``key=value`` as a dict; None when verl was not started)."""
    model = tmp_path / "ckpt"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(config))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    record = tmp_path / "verl_args.json"
    record.unlink(missing_ok=True)
    shim = bin_dir / "python"
    shim.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$1 $2" = "-m klear.integrations.verl" ]; then exit 0; fi\n'
        f'if [ "$1 $2" = "-m verl.trainer.main_ppo" ]; then shift 2; exec {sys.executable} -c '
        f'\'import json, sys; json.dump(sys.argv[1:], open("{record}", "w"))\' "$@"; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    shim.chmod(0o755)
    full_env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "STAGE": "math",
        "MODEL": str(model),
        "TRAIN": "t.parquet",
        "VAL": "v.parquet",
        **env,
    }
    proc = subprocess.run(["bash", str(SCRIPT)], env=full_env, capture_output=True, text=True, timeout=120)
    if not record.is_file():
        return proc, None
    args = json.loads(record.read_text())
    return proc, dict(a.split("=", 1) for a in args)


def test_a_32k_checkpoint_gets_its_context_raised_to_prompt_plus_response(tmp_path):
    proc, args = _run(tmp_path, {"max_position_embeddings": 32768})
    assert proc.returncode == 0, proc.stderr
    assert args is not None
    assert args[RAISE] == args[RAISE_VLLM] == args["actor_rollout_ref.rollout.max_model_len"] == "36864"
    assert (args["data.max_prompt_length"], args["data.max_response_length"]) == ("4096", "32768")
    assert "max_position_embeddings=32768 < 36864" in proc.stderr and "raising it to 36864" in proc.stderr


def test_a_long_enough_checkpoint_is_left_alone(tmp_path):
    proc, args = _run(tmp_path, {"text_config": {"max_position_embeddings": 40960}})
    assert proc.returncode == 0, proc.stderr
    assert args is not None and RAISE not in args and RAISE_VLLM not in args
    assert args["actor_rollout_ref.rollout.max_model_len"] == "36864"


def test_a_shorter_response_budget_keeps_a_32k_checkpoint_s_positions(tmp_path):
    proc, args = _run(tmp_path, {"max_position_embeddings": 32768}, RESPONSE_LENGTH="28672", CONTEXT_LENGTH="32768")
    assert proc.returncode == 0, proc.stderr
    assert args is not None and RAISE not in args
    assert (args["data.max_response_length"], args["actor_rollout_ref.rollout.max_model_len"]) == ("28672", "32768")


def test_a_context_that_would_cap_responses_is_refused(tmp_path):
    proc, args = _run(tmp_path, {"max_position_embeddings": 32768}, CONTEXT_LENGTH="32768")
    assert proc.returncode == 2 and args is None
    assert "CONTEXT_LENGTH=32768 < 4096 prompt + 32768 response tokens = 36864" in proc.stderr
    assert "verl would cap responses at 28672" in proc.stderr


def test_a_checkpoint_without_positions_is_refused_in_one_line(tmp_path):
    proc, args = _run(tmp_path, {"hidden_size": 8})
    assert proc.returncode != 0 and args is None
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .endswith("its config has no max_position_embeddings (expected a positive integer)")
    )
