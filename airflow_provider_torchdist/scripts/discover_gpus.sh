#!/usr/bin/env bash
# Spark resource discovery script: this host's NVIDIA GPUs, as Spark's JSON ResourceInformation.
# Used for the embedded local master with use_gpu=True; clusters may use it too
# (spark.executor.resource.gpu.discoveryScript).
set -euo pipefail
ids=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | tr -d ' ' | paste -sd, - || true)
addresses=$(echo "$ids" | sed -E 's/([0-9]+)/"\1"/g')
echo "{\"name\": \"gpu\", \"addresses\": [${addresses}]}"
