"""What the algorithm scripts share: log-prob / masking / KL utilities and KL controllers (core.py), chat templates
(chat.py), value-head, reference and reward models (models.py), loading by name (loading.py), the command line
(cli.py), output folders and atomic saves (outputs.py), checkpoints (checkpoints.py), run setup and logging (run.py),
sampling (sampling.py, the one door, with vllm_engine.py behind --use-vllm), the online scripts' rollout engine and
its tools (rollout.py, tools.py), verifiable tasks and reward functions (rewards.py), the fast paths (fast_paths.py).
Everything algorithm-specific stays in the scripts; the offline built-ins live in presets/. Nothing here imports a file
above it."""
