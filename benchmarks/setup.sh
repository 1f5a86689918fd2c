#!/usr/bin/env bash
# The benchmark's peers, kept out of requirements.txt and out of site-packages: TRL's current release (SFT, reward
# model, DPO) and TRL 0.8.6 (the last one with PPOTrainer and DDPOTrainer), each in its own folder without its
# dependencies (both import with this repository's torch / transformers / accelerate / datasets).
set -euo pipefail
cd "$(dirname "$0")"
TRL_CURRENT=${TRL_CURRENT:-1.16.0}
python3 -m pip install -q --no-deps --target .trl-current "trl==${TRL_CURRENT}"
python3 -m pip install -q --no-deps --target .trl-0.8.6 trl==0.8.6
python3 -m pip install -q pandas pyarrow jinja2 psutil  # TRL's own small dependencies
echo "TRL installed in benchmarks/.trl-current ($TRL_CURRENT) and benchmarks/.trl-0.8.6"
