#!/bin/bash
# H6's GPU convergence run (temporary; removed after the run).
cd "$(dirname "$0")/.."
python -c "import pluggy" 2>/dev/null || export PYTHONPATH=$PWD/_gpu_h6:$PYTHONPATH
python -c "import pluggy; print('pluggy', pluggy.__version__)"
pip install -q --no-deps --no-build-isolation -e . -e backends/triton -e backends/cuda > $OUT/pip.log 2>&1 || echo "pip failed"
tail -3 $OUT/pip.log
python -m te_core info > $OUT/info.txt 2>&1; head -40 $OUT/info.txt
STEPS=${STEPS:-2000}
if TE_BACKEND=cuda python -c "import te_core; te_core.get_backend()" 2>/dev/null; then B="--backend cuda"; else B="--device cuda"; fi
echo "using $B"
timeout ${LIMIT:-520} python -m te_core.demo $B --size large --steps $STEPS --recipe ${RECIPE:-delayed} --out $OUT --no-progress 2>&1 | tail -25
nvidia-smi --query-gpu=name,memory.used --format=csv
