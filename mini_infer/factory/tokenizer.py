"""The real Qwen2.5 tokenizer, rebuilt offline from the BPE ranks shipped in the `dashscope` package.

Owns the conversion to a Hugging Face tokenizer.json, its on-disk cache, and tokenizer_config.json.
"""

import base64
import hashlib
import importlib.util
import json
import os
import tempfile
from pathlib import Path

from mini_infer.paths import cache_dir

# Bump when the built tokenizer.json changes, so stale cache entries are not reused.
BUILDER_VERSION = "qwen2.5-tokenizer-v1"

# Qwen's pre-tokenizer: like cl100k's, but digits are split one at a time.
PRETOKENIZE_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

FIRST_ADDED_TOKEN_ID = 151643
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Added as plain (non-special) tokens, so decode(skip_special_tokens=True) keeps them.
CONTROL_TOKENS = [
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
]
ADDED_TOKENS = SPECIAL_TOKENS + CONTROL_TOKENS
# Qwen3 adds these after Qwen2.5's (ids 151665-151668), also plain: a reasoning parser reads <think> in the output.
QWEN3_CONTROL_TOKENS = ["<tool_response>", "</tool_response>", "<think>", "</think>"]

DEFAULT_SYSTEM_PROMPT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

# The template pieces both families share, in our own words where they have prose. The tools listing: their
# signatures inside <tools></tools>, and calls asked for as {"name": ..., "arguments": {...}} inside
# <tool_call></tool_call> (it follows the system turn's opening and ends it).
_TOOLS_LISTING = (
    "# Tools\\n\\nYou can call the functions whose signatures are listed inside <tools></tools>:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' ~ (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nTo call one, answer with its name and arguments as a JSON object inside "
    "<tool_call></tool_call> tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' -}}"
)
# `tool` messages go back as a user turn of <tool_response></tool_response> blocks (consecutive ones in one turn).
_TOOL_RESPONSE = (
    "{%- if message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' ~ (message['content'] or '') ~ '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
)
# An assistant turn's tool_calls, each in the form the tools listing asks for.
_TOOL_CALLS = (
    "{%- for call in message['tool_calls'] -%}"
    "{%- set function = call['function'] if call['function'] is defined else call -%}"
    "{%- if message['content'] or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": \"' ~ function['name'] ~ '\", \"arguments\": ' ~ "
    "(function['arguments'] | tojson) ~ '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
)
_OTHER_TURN = (
    "{%- elif not (tools and loop.first and message['role'] == 'system') -%}"
    "{{- '<|im_start|>' ~ message['role'] ~ '\\n' ~ (message['content'] or '') ~ '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

# Qwen2.5-Instruct's ChatML: a default system prompt when the messages have none, and tool calls as Qwen2.5 was
# trained to read them.
CHAT_TEMPLATE = (
    "{%- set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' "
    "else '" + DEFAULT_SYSTEM_PROMPT + "' -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' ~ system ~ '\\n\\n" + _TOOLS_LISTING +
    "{%- elif not messages or messages[0]['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\n' ~ system ~ '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}" + _TOOL_RESPONSE +
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] -%}"
    "{{- '<|im_start|>assistant\\n' ~ (message['content'] or '') -}}" + _TOOL_CALLS +
    "{{- '<|im_end|>\\n' -}}" + _OTHER_TURN +
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

# Qwen3's ChatML with its thinking switch: no default system prompt; an assistant turn after the last user turn keeps
# its reasoning_content in a <think></think> block (earlier turns drop theirs); with enable_thinking false
# (chat_template_kwargs) the generation prompt ends in an empty think block, so the model answers without thinking.
QWEN3_CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}{{- messages[0]['content'] ~ '\\n\\n' -}}{%- endif -%}"
    "{{- '" + _TOOLS_LISTING +
    "{%- endif -%}"
    "{%- for message in messages -%}" + _TOOL_RESPONSE +
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if message['reasoning_content'] and loop.index0 > ns.last_user -%}"
    "{{- '<think>\\n' ~ message['reasoning_content'] ~ '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- message['content'] or '' -}}"
    "{%- if message['tool_calls'] -%}" + _TOOL_CALLS + "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}" + _OTHER_TURN +
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)

# A tokenizer family: its added tokens (in id order from FIRST_ADDED_TOKEN_ID) and its chat template.
_FAMILIES = {"qwen2.5": (ADDED_TOKENS, CHAT_TEMPLATE),
             "qwen3": (ADDED_TOKENS + QWEN3_CONTROL_TOKENS, QWEN3_CHAT_TEMPLATE)}


def qwen_vocab_path() -> Path:
    # find_spec does not import dashscope itself, which would pull in its HTTP client stack.
    spec = importlib.util.find_spec("dashscope")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "the Qwen2.5 vocabulary comes from the PyPI package 'dashscope'; "
            "install it with `pip install dashscope`",
            name="dashscope",
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / "resources" / "qwen.tiktoken"
        if path.is_file():
            return path
    raise ImportError("the installed 'dashscope' package has no resources/qwen.tiktoken", name="dashscope")


def _load_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _build_tokenizer_json(vocab_path: Path) -> str:
    import tiktoken
    from tokenizers import AddedToken, Tokenizer, normalizers
    from transformers.integrations.tiktoken import convert_tiktoken_to_fast

    encoding = tiktoken.Encoding(
        name="qwen2.5",
        pat_str=PRETOKENIZE_PATTERN,
        mergeable_ranks=_load_ranks(vocab_path),
        special_tokens={},
    )
    with tempfile.TemporaryDirectory() as scratch:
        # The converter also dumps a tiktoken/ copy of the ranks; only tokenizer.json is kept.
        convert_tiktoken_to_fast(encoding, scratch)
        tokenizer = Tokenizer.from_file(str(Path(scratch) / "tokenizer.json"))

    tokenizer.normalizer = normalizers.NFC()
    # Published Qwen2.5 tokenizer.json runs full BPE merges rather than whole-word vocab lookups.
    tokenizer.model.ignore_merges = False
    for content in ADDED_TOKENS:
        special = content in SPECIAL_TOKENS
        token = AddedToken(content, special=special, normalized=False)
        if special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
    ids = [tokenizer.token_to_id(content) for content in ADDED_TOKENS]
    expected = list(range(FIRST_ADDED_TOKEN_ID, FIRST_ADDED_TOKEN_ID + len(ADDED_TOKENS)))
    assert ids == expected, f"added tokens got ids {ids}, expected {expected}"
    return tokenizer.to_str(pretty=True)


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp_name, 0o644)  # mkstemp creates it owner-only
        os.replace(tmp_name, path)
    except BaseException:
        os.unlink(tmp_name)
        raise


def cached_tokenizer_json(family: str = "qwen2.5") -> Path:
    """Path of the built tokenizer.json of `family`, converting the vocabulary on first use (~4 s); Qwen3's is
    Qwen2.5's with four more added tokens, kept beside it (adding them means parsing the file: ~0.7 s)."""
    if family not in _FAMILIES:
        raise ValueError(f"tokenizer family must be one of {sorted(_FAMILIES)}, got {family!r}")
    vocab_path = qwen_vocab_path()
    digest = hashlib.sha256(vocab_path.read_bytes())
    digest.update(BUILDER_VERSION.encode())
    path = cache_dir() / "tokenizers" / f"qwen2.5-{digest.hexdigest()[:16]}.json"
    if not path.is_file():
        _atomic_write_text(path, _build_tokenizer_json(vocab_path))
    if family == "qwen2.5":
        return path
    more = _FAMILIES[family][0][len(ADDED_TOKENS):]
    digest.update("\0".join(more).encode())  # the family's own tokens name its file too
    derived = path.with_name(f"{family}-{digest.hexdigest()[:16]}.json")
    if not derived.is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(path))
        tokenizer.add_tokens(more)
        _atomic_write_text(derived, tokenizer.to_str(pretty=True))
    return derived


def tokenizer_config(family: str = "qwen2.5") -> dict:
    """tokenizer_config.json contents matching Qwen2.5-Instruct's (or Qwen3's), with our own chat template."""
    added, template = _FAMILIES[family]
    added_tokens_decoder = {
        str(FIRST_ADDED_TOKEN_ID + offset): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": content in SPECIAL_TOKENS,
        }
        for offset, content in enumerate(added)
    }
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder,
        "additional_special_tokens": SPECIAL_TOKENS[1:],
        "bos_token": None,
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_tokenizer(out_dir: str | os.PathLike, family: str = "qwen2.5") -> None:
    """Write tokenizer.json and tokenizer_config.json for the Qwen2.5 tokenizer (family "qwen2.5") or Qwen3's (the
    same vocabulary, four more added tokens and the thinking chat template) into out_dir."""
    source = cached_tokenizer_json(family)  # (which refuses an unknown family)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_bytes(source.read_bytes())
    _write_tokenizer_config(out_dir, family)


def refresh_tokenizer_config(model_dir: Path) -> bool:
    """Rewrite a checkpoint's tokenizer_config.json if an earlier mini-infer wrote another chat template (the
    template grew tool calls); True if it did."""
    path = model_dir / "tokenizer_config.json"
    if json.loads(path.read_text(encoding="utf-8")).get("chat_template") == CHAT_TEMPLATE:
        return False
    _write_tokenizer_config(model_dir)
    return True


def _write_tokenizer_config(out_dir: Path, family: str = "qwen2.5") -> None:
    config_text = json.dumps(tokenizer_config(family), indent=2, ensure_ascii=False) + "\n"
    staging = out_dir / f".tokenizer_config.json.{os.getpid()}"
    staging.write_text(config_text, encoding="utf-8")
    staging.replace(out_dir / "tokenizer_config.json")  # whole, for a reader at the same time
