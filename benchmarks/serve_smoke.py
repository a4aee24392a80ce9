# SPDX-License-Identifier: Apache-2.0
"""`VLLM_ATTENTION_BACKEND=MOIRA vllm serve` answers OpenAI completions (H200).

Starts the server exactly as a user would (the environment variable, no
--attention-backend and no --block-size: Moira picks 64 itself), waits for
/health, sends completion requests on loopback, checks the answers, reads the
backend and block size from the log, and stops the server. Writes a JSON record.

    python benchmarks/serve_smoke.py --out benchmarks/results/serve_smoke_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def http_json(url: str, payload: dict | None = None, timeout: float = 120.0):
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        body = response.read().decode()
    return json.loads(body) if body.strip().startswith(("{", "[")) else body


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="shared/gpu/models/Llama-3.1-8B")
    parser.add_argument("--tokenizer", default="shared/gpu/models/tokenizer-smollm2")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--max-model-len", type=int, default=16384)
    parser.add_argument("--startup-timeout", type=float, default=400.0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--log", default=None, help="server log path (default: next to --out)")
    args = parser.parse_args()

    log_path = Path(args.log or Path(args.out).with_suffix(".log"))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, VLLM_ATTENTION_BACKEND="MOIRA")
    command = [
        "vllm", "serve", args.model, "--load-format", "dummy", "--tokenizer", args.tokenizer,
        "--max-model-len", str(args.max_model_len), "--max-num-seqs", "32",
        "--host", "127.0.0.1", "--port", str(args.port),
    ]  # fmt: skip
    record: dict = {"command": "VLLM_ATTENTION_BACKEND=MOIRA " + " ".join(command)}
    base = f"http://127.0.0.1:{args.port}"
    start = time.time()
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            while time.time() - start < args.startup_timeout:
                if server.poll() is not None:
                    raise RuntimeError(f"server exited with {server.returncode}")
                try:
                    urllib.request.urlopen(base + "/health", timeout=5)
                    break
                except OSError:
                    time.sleep(2)
            else:
                raise TimeoutError(f"no /health after {args.startup_timeout:.0f}s")
            record["startup_s"] = time.time() - start
            print(f"server up after {record['startup_s']:.0f}s", flush=True)
            answers = []
            prompts = [
                "The capital of France is",
                " ".join(["Long context keeps going."] * 900) + " Summary:",
            ]
            for prompt in prompts:
                reply = http_json(
                    base + "/v1/completions",
                    {"model": args.model, "prompt": prompt, "max_tokens": 32, "temperature": 0},
                )
                choice = reply["choices"][0]
                answers.append(
                    {
                        "prompt_chars": len(prompt),
                        "prompt_tokens": reply["usage"]["prompt_tokens"],
                        "completion_tokens": reply["usage"]["completion_tokens"],
                        "text": choice["text"],
                        "finish_reason": choice["finish_reason"],
                    }
                )
                print("completion:", answers[-1], flush=True)
            record["completions"] = answers
            time.sleep(12)  # one stats interval, so the frontend has exported the gauge
            metrics = http_json(base + "/metrics")
            record["moira_metrics"] = [
                line for line in str(metrics).splitlines() if "moira" in line.lower()
            ][:10]
            print("moira metrics:", record["moira_metrics"], flush=True)
            record["ok"] = all(a["completion_tokens"] == 32 for a in answers)
        except Exception as error:  # recorded, and the exit code says it failed
            record["ok"] = False
            record["error"] = repr(error)
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
    text = log_path.read_text(errors="replace")
    backend = re.findall(r"Using (?:AttentionBackendEnum\.)?(\w+) (?:attention )?backend", text)
    record["backend_log_lines"] = sorted(set(backend))[:5]
    record["block_size_log"] = re.findall(r"block_size[=: ]+(\d+)", text)[:3]
    record["moira_in_log"] = "MOIRA" in text
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: record[k] for k in ("ok", "backend_log_lines", "moira_in_log")}))
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
