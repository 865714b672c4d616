#!/usr/bin/env bash
# A check of the TUI in a real terminal: tmux starts mlxchat, types a question, waits for the streamed answer,
# captures the pane and greps it for the answer and the readouts (TTFT, TPOT, tok/s, context). Then it asks for
# a long reply and presses Esc mid-stream, and checks the reply says it was stopped.
#
#   scripts/tmux_check.sh [OUT_FILE]        (default /tmp/mlxchat-tmux-pane.txt; the Esc pane goes to OUT.esc.txt)
#
# Uses throwaway data/config folders (MLXCHAT_DATA_DIR / MLXCHAT_CONFIG_DIR) with the greedy "precise" profile,
# so the answer is the same each run. Needs tmux (apt-get install -y tmux).
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${1:-/tmp/mlxchat-tmux-pane.txt}
QUESTION=${QUESTION:-"What is the capital of France?"}
EXPECT=${EXPECT:-Paris}
SESSION="mlxchat-check-$$"
WORK=$(mktemp -d)

command -v tmux >/dev/null || { echo "tmux is not installed: apt-get install -y tmux" >&2; exit 2; }
# Long enough that the story below is still streaming when the pane is polled for "decoding" (every 0.5 s): 40
# tokens were done in 0.3 s at ~140 tok/s, before the first poll. The question's answer ends on its own.
if [ -x .venv/bin/mlxchat ] && .venv/bin/python -c "import mlxchat.app.cli" 2>/dev/null; then
    CMD=".venv/bin/mlxchat chat --max-tokens 600"
else
    CMD=".venv/bin/python -m mlxchat.app chat --max-tokens 600"
fi
mkdir -p "$WORK/config"
printf 'profile = "precise"\n' > "$WORK/config/config.toml"

cleanup() { tmux kill-session -t "$SESSION" 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

pane() { tmux capture-pane -p -t "$SESSION"; }
wait_for() {  # wait_for PATTERN SECONDS
    local deadline=$((SECONDS + $2))
    until pane | grep -q -- "$1"; do
        if [ $SECONDS -ge $deadline ]; then
            echo "FAIL: no '$1' on the pane after $2 s; the pane was:" >&2; pane >&2; exit 1
        fi
        sleep 0.5
    done
}

echo "starting: $CMD"
tmux new-session -d -s "$SESSION" -x 120 -y 36 \
    "MLXCHAT_DATA_DIR=$WORK/data MLXCHAT_CONFIG_DIR=$WORK/config $CMD; sleep 30"
start=$SECONDS
wait_for "Send" 60                              # the UI is up (the footer)
echo "UI visible after $((SECONDS - start)) s"
wait_for "context 8192" 120                     # the model loaded in the background
echo "model loaded after $((SECONDS - start)) s"

tmux send-keys -t "$SESSION" -l "$QUESTION"
tmux send-keys -t "$SESSION" Enter
wait_for "to first token" 120                   # the per-message stats line: the reply is complete
sleep 0.5
pane > "$OUT"
echo "--- pane after the answer ($OUT) ---"
cat "$OUT"

status=0
check() {  # check LABEL PATTERN
    if grep -q -i -- "$2" "$OUT"; then echo "ok: $1"; else echo "MISSING: $1 ($2)"; status=1; fi
}
check "the question" "$QUESTION"
check "the answer" "$EXPECT"
check "TTFT readout" "TTFT [0-9]"
check "TPOT readout" "TPOT [0-9]"
check "decode tok/s" "[0-9.]* tok/s"
check "context used/limit" "ctx [0-9]*/8192"
check "per-message stats" "tokens · [0-9.]* m\?s to first token"

# Esc mid-stream, in a real terminal (Esc arrives as a bare ESC byte there).
tmux send-keys -t "$SESSION" -l "Write a long story about a dragon and a knight."
tmux send-keys -t "$SESSION" Enter
wait_for "decoding" 60
tmux send-keys -t "$SESSION" Escape
wait_for "stopped by you" 30
pane > "$OUT.esc.txt"
echo "--- pane after Esc ($OUT.esc.txt) ---"
cat "$OUT.esc.txt"
grep -q "stopped by you" "$OUT.esc.txt" && echo "ok: Esc stopped the reply" || { echo "MISSING: Esc"; status=1; }

[ $status -eq 0 ] && echo "PASS" || echo "FAIL"
exit $status
