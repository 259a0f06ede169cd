#!/usr/bin/env bash
# Replays issue 16 ("a newcomer's first hour") on a fresh clone, in a fresh venv, with a
# plain `pip install .` and then the documented extra, following the README in order.
# Prints each step's outcome and exits non-zero if any failed. Takes 15-25 minutes on 2
# cores (the char-GPT example alone is ~5); not part of `make test`.
#
#   scripts/newcomer_replay.sh [WORKDIR]      # default: a new folder under /tmp
#
# The cluster step needs root (network namespaces); elsewhere it is reported as skipped.
set -uo pipefail

# LOCKSTEP_REPO: the clone to replay (default: the one holding this script). Run a copy of
# this script when editing the original meanwhile: bash reads a script as it goes.
REPO=${LOCKSTEP_REPO:-$(git -C "$(dirname "$0")" rev-parse --show-toplevel)}
W=${1:-$(mktemp -d /tmp/lockstep-newcomer.XXXXXX)}
PY=${PYTHON:-python3}
FAILED=0
mkdir -p "$W"
exec 3>&1  # step outcomes go to the terminal; command output to $W/logs

pass() { echo "PASS  $1" >&3; }
fail() { echo "FAIL  $1" >&3; FAILED=$((FAILED + 1)); }
check() {  # check NAME CONDITION...: run the condition, report
    local name=$1; shift
    if "$@"; then pass "$name"; else fail "$name"; fi
}
has() { grep -q -- "$2" "$1"; }           # has FILE TEXT
lacks() { ! grep -q -- "$2" "$1"; }
count() { grep -c -- "$2" "$1"; }
log() { echo "$W/logs/$1"; }
mkdir -p "$W/logs"

echo "== workdir $W; repository $REPO at $(git -C "$REPO" rev-parse --short HEAD)" >&3
git clone -q "$REPO" "$W/lockstep" && pass "fresh clone" || { fail "fresh clone"; exit 1; }
cd "$W/lockstep" || exit 1
$PY -m venv "$W/venv" && pass "fresh venv ($($PY --version))" || exit 1
source "$W/venv/bin/activate"

echo "== plain pip install ." >&3
SECONDS=0
pip install --quiet . >"$(log pip-plain)" 2>&1
check "pip install . (${SECONDS}s)" test $? -eq 0
check "finding 10: pip install . leaves no build/ or *.egg-info in the clone" \
    test -z "$(git status --short --ignored)"
lockstep --version >"$(log version)" 2>&1
check "finding 10: lockstep --version -> $(cat "$(log version)")" has "$(log version)" "^lockstep 0"
lockstep env >"$(log env)" 2>&1
env_ok() { has "$1" '^torch: ' && has "$1" 'backends built: .*gloo' && has "$1" '^cores usable'; }
check "expected: lockstep env lists versions, backends, cores" env_ok "$(log env)"

# Finding 2: without the [data] extra the demo says what to install, in one line.
lockstep demo --out "$W/runs/demo" >"$(log demo-nodata.out)" 2>"$(log demo-nodata.err)"
code=$?
nodata_ok() { [ "$1" = 2 ] && [ "$(wc -l < "$2")" = 1 ] && has "$2" "pip install 'lockstep\[data\]'"; }
check "finding 2: demo without data: exit $code, one line: $(head -c 140 "$(log demo-nodata.err)")" \
    nodata_ok "$code" "$(log demo-nodata.err)"
check "finding 1/2: the failed demo made no folder" test ! -e "$W/runs/demo"

# Finding 9: optional pieces missing (no matplotlib, no TensorBoard) are reported once.
cat > "$W/tiny.py" <<'EOF'
import torch, lockstep
from torch.utils.data import TensorDataset
x = torch.randn(512, 8)
data = TensorDataset(x, (x.sum(1) > 0).long())
config = lockstep.TrainConfig(global_batch_size=32, epochs=3, run_dir="runs/tiny",
                              progress=False, log_every_steps=4)
lockstep.Trainer(lambda: torch.nn.Linear(8, 2), torch.optim.Adam, data, data,
                 config=config).fit()
EOF
(cd "$W" && lockstep run -n 2 tiny.py) >"$(log tiny.out)" 2>&1
check "finding 9: no matplotlib -> one line saying so: $(grep -o 'skipped training.png.*' "$(log tiny.out)")" \
    test "$(count "$(log tiny.out)" 'skipped training.png: pip install matplotlib')" = 1
check "finding 9: no TensorBoard -> one line saying so" \
    test "$(count "$(log tiny.out)" 'skipped tensorboard logging: pip install tensorboard')" = 1

echo "== pip install '.[data,plots]' (the documented extras)" >&3
SECONDS=0
pip install --quiet '.[data,plots]' >"$(log pip-extras)" 2>&1
check "pip install '.[data,plots]' (${SECONDS}s)" test $? -eq 0
check "still nothing left in the clone" test -z "$(git status --short --ignored)"

echo "== the demo (README: Two commands), into a folder that holds the user's files" >&3
mkdir -p "$W/runs/important" && echo "do not lose me" > "$W/runs/important/notes.txt"
SECONDS=0
lockstep demo --out "$W/runs" >"$(log demo1.out)" 2>"$(log demo1.err)"
check "demo runs (${SECONDS}s)" test $? -eq 0
sed -n '/^====/,$p' "$(log demo1.out)" | sed 's/^/      | /' >&3
check "finding 1: --out holding the user's files: nothing deleted" \
    test "$(cat "$W/runs/important/notes.txt")" = "do not lose me"
check "finding 1: the demo wrote into a new run-1" test -f "$W/runs/run-1/2-workers/training.png"
check "finding 4: the demo's bar ends at 100% (372/372)" has "$(log demo1.err)" "372/372"
check "finding 10: the bar labels bytes sent per step" has "$(log demo1.err)" "sent/step="
lockstep demo --out "$W/runs" --skip-single >"$(log demo2.out)" 2>"$(log demo2.err)"
first=$(grep -o 'fingerprint: [0-9a-f]*' "$(log demo1.out)")
second=$(grep -o 'fingerprint: [0-9a-f]*' "$(log demo2.out)")
check "finding 3: a second demo repeats the $first on this machine ($second)" \
    test -n "$first" -a "$first" = "$second"
check "finding 1: the second demo went to run-2; run-1 untouched" \
    test -f "$W/runs/run-2/2-workers/summary.json" -a -f "$W/runs/run-1/2-workers/summary.json"

echo "== README: A training script, as written" >&3
readme_block() {  # the first ```python block after the heading $1
    awk -v h="$1" '$0 == h {found=1} found && /^```python/ {on=1; next} on && /^```/ {exit}
                   on {print}' README.md
}
readme_block "## A training script" > "$W/train.py"
(cd "$W" && python train.py) >"$(log train1.out)" 2>&1
check "python train.py: $(grep -o 'epoch 2: loss [0-9.]*' "$(log train1.out)")" has "$(log train1.out)" "epoch 2: loss"
(cd "$W" && lockstep run -n 2 train.py) >"$(log train2.out)" 2>&1
check "lockstep run -n 2 train.py: $(grep -o 'epoch 2: loss [0-9.]*' "$(log train2.out)")" has "$(log train2.out)" "epoch 2: loss"

echo "== README: The Trainer, as written, then again" >&3
readme_block "## The Trainer" > "$W/trainer.py"
(cd "$W" && lockstep run -n 2 trainer.py) >"$(log trainer1.out)" 2>&1
check "lockstep run -n 2 trainer.py" has "$(log trainer1.out)" "'test_accuracy'"
check "finding 4: the Trainer's bar ends at 75/75" has "$(log trainer1.out)" "75/75"
check "expected: config.json in the run folder" test -f "$W/runs/mnist/config.json"
check "expected: training.png in the run folder" test -f "$W/runs/mnist/training.png"
(cd "$W" && lockstep run -n 2 trainer.py) >"$(log trainer2.out)" 2>&1
check "finding 5: the same command again: $(grep -o 'run already complete.*' "$(log trainer2.out)")" \
    has "$(log trainer2.out)" "run already complete at step 75"
for seed_run in a b; do
    sed "s#runs/mnist#runs/mnist-$seed_run#" "$W/trainer.py" > "$W/trainer_$seed_run.py"
    (cd "$W" && lockstep run -n 2 "trainer_$seed_run.py") >"$(log "trainer_$seed_run.out")" 2>&1
done
fp() { grep -o "'fingerprint': '[0-9a-f]*'" "$1"; }
check "finding 6: three runs of the snippet, one fingerprint: $(fp "$(log trainer1.out)")" \
    test -n "$(fp "$(log trainer1.out)")" -a "$(fp "$(log trainer1.out)")" = "$(fp "$(log trainer_a.out)")" \
         -a "$(fp "$(log trainer_a.out)")" = "$(fp "$(log trainer_b.out)")"
cat > "$W/infer.py" <<'EOF'
import torch, lockstep
from lockstep.demo.data import mnist
from lockstep.demo.models import small_cnn
_, test_set = mnist()
net = lockstep.load_weights(small_cnn(), "runs/mnist/model.pt").eval()  # no optimizer, no wrapper
x, y = test_set.tensors
with torch.no_grad():
    print(f"exported weights: test accuracy {(net(x).argmax(1) == y).float().mean().item():.4f}")
EOF
(cd "$W" && python infer.py) >"$(log infer.out)" 2>&1
trained=$(grep -o "'test_accuracy': [0-9.]*" "$(log trainer1.out)" | grep -o '[0-9.]*$')
exported=$(grep -o 'test accuracy [0-9.]*' "$(log infer.out)" | grep -o '[0-9.]*$')
check "expected: exported weights in a plain model: accuracy $exported (trained: $trained)" \
    python -c "import sys; sys.exit(abs(float('$exported') - float('$trained')) > 1e-6)"

echo "== README: Launching" >&3
lockstep run -n 4 examples/train_mnist.py --epochs 3 >"$(log launch4.out)" 2>&1
check "lockstep run -n 4 examples/train_mnist.py --epochs 3: $(grep -o 'test accuracy: .*' "$(log launch4.out)")" has "$(log launch4.out)" "test accuracy"
torchrun --nproc-per-node=4 examples/train_mnist.py >"$(log torchrun.out)" 2>&1
check "torchrun --nproc-per-node=4 examples/train_mnist.py" has "$(log torchrun.out)" "test accuracy"
python examples/train_mnist.py >"$(log plain.out)" 2>&1
check "python examples/train_mnist.py" has "$(log plain.out)" "test accuracy"
for bad in "-n 0" "--nnodes 2"; do
    lockstep run $bad examples/train_mnist.py >"$(log bad.out)" 2>&1
    code=$?
    usage_ok() { [ "$1" = 2 ] && has "$2" 'usage: lockstep run' && lacks "$2" Traceback; }
    check "finding 7: lockstep run $bad: exit $code, $(grep -o 'error: .*' "$(log bad.out)")" \
        usage_ok "$code" "$(log bad.out)"
done

echo "== Ctrl-C during the char-GPT, then the same command again" >&3
CMD=(lockstep run -n 2 examples/char_gpt.py --max-steps 100 --out "$W/runs/ctrlc"
     --set trainer.checkpoint.every_steps=20)
setsid "${CMD[@]}" >"$(log ctrlc.out)" 2>&1 &
job=$!
for _ in $(seq 600); do
    [ "$(ls "$W/runs/ctrlc/checkpoints" 2>/dev/null | grep -c '^step-')" -ge 1 ] && break
    sleep 0.5
done
sleep 2
kill -INT -- "-$job"  # what Ctrl-C in a terminal sends: the launcher's process group
wait $job
code=$?
lines=$(tr '\r' '\n' < "$(log ctrlc.out)" | grep -v '^train:' | grep -cv '^\s*$')
ctrlc_ok() { [ "$1" = 130 ] && [ "$2" -le 3 ] && lacks "$3" Traceback && has "$3" 'last checkpoint: .*step-'; }
check "finding 7: Ctrl-C: exit $code, $lines lines, no traceback: $(grep -o 'lockstep run: interrupted.*' "$(log ctrlc.out)")" \
    ctrlc_ok "$code" "$lines" "$(log ctrlc.out)"
"${CMD[@]}" >"$(log resume.out)" 2>&1
resumed_ok() { has "$1" 'resumed from' && has "$1" 'test loss'; }
check "the same command resumes: $(grep -o 'resumed from .*step-[0-9]*' "$(log resume.out)")" \
    resumed_ok "$(log resume.out)"

echo "== README: char_gpt as written (timed)" >&3
SECONDS=0
lockstep run -n 2 examples/char_gpt.py >"$(log chargpt.out)" 2>&1
check "finding 3: lockstep run -n 2 examples/char_gpt.py took ${SECONDS}s: $(grep -o 'test loss.*' "$(log chargpt.out)")" \
    has "$(log chargpt.out)" "test loss"

echo "== lockstep cluster (as root)" >&3
if [ "$(id -u)" = 0 ] && command -v ip >/dev/null; then
    lockstep cluster --hosts 2 --bandwidth 100mbit -- \
        lockstep run -n 2 --nnodes 2 --node-rank '{host}' --local-addr '{addr}' \
        --rdzv-endpoint '{host0}:29400' examples/train_mnist.py --epochs 1 \
        >"$(log cluster.out)" 2>&1
    prefixed_ok() { has "$1" '^\[host 0\] test accuracy' && ! grep -qv '^\[host [01]\] ' "$1"; }
    check "finding 8: the README's cluster command: every line prefixed by its host" \
        prefixed_ok "$(log cluster.out)"
    sed 's/^/      | /' "$(log cluster.out)" | tr '\r' '\n' | grep -v 'train:' | head -12 >&3
else
    echo "SKIP  finding 8: lockstep cluster needs root" >&3
fi

echo "== PNGs written" >&3
find "$W" -name '*.png' -not -path '*/venv/*' | sort | sed 's/^/      /' >&3
check "nothing written into the clone by any of it" test -z "$(git status --short)"
echo "== $FAILED step(s) failed; logs in $W/logs" >&3
exit $((FAILED > 0))
