"""Run llama.cpp's own `convert_hf_to_gguf.py` from a llama.cpp source tree, as an external tool.

    python3 tools/llamacpp_convert.py LLAMA_CPP_DIR PRE MODEL_DIR [converter arguments...]

Used by the peer tests and the conversion benchmark (never copied into this project). Two
adjustments let it read self-trained tokenizers: llama.cpp recognises a pre-tokenizer by the hash of
its output on a fixed text, which a locally trained tokenizer cannot match, so `get_vocab_base_pre`
returns PRE (e.g. qwen35, glm4); and the LLaMA-family classes probe for a SentencePiece model first,
which these byte-level BPE tokenizers do not have.
"""

import runpy
import sys


def main() -> None:
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    root, pre = sys.argv[1], sys.argv[2]
    sys.path.insert(0, root)
    sys.path.insert(0, root + "/gguf-py")
    import conversion.base as base

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre

    def no_sentencepiece(self):
        raise FileNotFoundError("byte-level BPE tokenizer: no tokenizer.model")

    base.TextModel._create_vocab_sentencepiece = no_sentencepiece
    sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[3:]
    runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")


if __name__ == "__main__":
    main()
