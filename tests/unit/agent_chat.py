"""Chat tokenizers for the agent tests, built in code: a character tokenizer with ChatML specials and
Qwen2.5's tool-calling chat template (its structure: tools in the system message inside <tools>,
consecutive tool results grouped into one user turn of <tool_response> blocks), and the tiny models'
plain template (which ignores `tools=`); and one worked calculator call as demonstrations
(`agent.demonstrations`), for the tests that put it before a task."""

from __future__ import annotations

from typing import Any

from rljob_trainer.model import modeling
from rljob_trainer.rollout import tools

#: A worked calculator call and its answer, as `agent.demonstrations` writes them (numbers of their own:
#: the tests find them in the rendered prompt).
DEMONSTRATIONS = [
    {"role": "user", "content": "What is 23+58?"},
    {"role": "assistant", "content": tools.format_tool_call(tools.ToolCall("calc", {"expression": "23+58"}))},
    {"role": "tool", "name": "calc", "content": "81"},
    {"role": "assistant", "content": "81"},
]

# Qwen2.5-Instruct's template, less its assistant-tool_calls branch (rljob never renders a model turn).
QWEN25_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}"
    '{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}'
    '{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}'
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, '
    '\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}'
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}"
    "{%- endif %}{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def chatml_tokenizer() -> Any:
    """Printable ASCII + newline, one token per character, with <|im_start|> and <|im_end|> (its EOS)
    as single special tokens, and Qwen2.5's tool template."""
    tok = modeling.build_char_tokenizer(modeling.CHARSETS["builtin-char"])
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = QWEN25_TEMPLATE
    return tok


def char_tokenizer() -> Any:
    """The tiny models' tokenizer and their plain chat template (no tools support)."""
    tok = modeling.build_char_tokenizer(modeling.CHARSETS["builtin-char"])
    tok.chat_template = modeling.CHAR_CHAT_TEMPLATE
    return tok
