"""Chat templates: what minillm renders for /v1/chat/completions, /tokenize and LLM.chat is what
transformers' apply_chat_template renders for the same template and messages, shaped as vLLM
shapes an OpenAI request's messages; bad templates and bad chat input are 400s, and a template
that runs away is stopped by the render's bounds (minillm/chat_template.py).

The templates below are public ones (Llama 3.x, Qwen2.5 with tools, Qwen3 with enable_thinking,
Mixtral, Gemma, Gemma 3, Phi-3, ChatML, DeepSeek-R1), written out as data, on stories260K's tokenizer.
"""
from __future__ import annotations

import copy
import sys
import threading
import json
import shutil
from datetime import datetime, timedelta
from pathlib import Path

import httpx
import pytest
from test_server_helpers import openai_error, running_server

from minillm.server.app import ServerOptions
from minillm.server.protocol import TokenizeChatRequest, messages_as_dicts
from minillm.server.serving_chat import template_kwargs
from minillm.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

LLAMA3 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

MIXTRAL = r"""{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\n\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""

GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
         "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
         "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
         "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
         "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")

GEMMA3 = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

PHI3 = ("{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + '<|end|>\n'}}"
        "{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
        "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

DEEPSEEK_R1 = ("{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', is_first_sp=true) %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}"
    "{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}{%- else %}"
    "{% set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}{%- endif %}{%- endif %}{%- endfor %}"
    "{{ bos_token }}{{ ns.system_prompt }}"
    "{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and 'tool_calls' in message %}{%- set ns.is_tool = false -%}"
    "{%- for tool in message['tool_calls'] %}{%- if not ns.is_first %}{%- if message['content'] is none %}"
    "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] | tojson + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"
    "{%- else %}{{'<｜Assistant｜>' + message['content'] + '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] | tojson + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"
    "{%- endif %}{%- set ns.is_first = true -%}{%- else %}"
    "{{'\\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] | tojson + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"
    "{%- endif %}{%- endfor %}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and 'tool_calls' not in message %}{%- if ns.is_tool %}"
    "{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}{%- else %}"
    "{% set content = message['content'] %}{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}"
    "{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}"
    "{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- set ns.is_output_first = false %}"
    "{%- else %}{{'<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- endif %}{%- endif %}{%- endfor -%}"
    "{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\\n'}}{% endif %}")

# Cohere-style RAG: documents rendered by the template.
DOCS = ("{{ bos_token }}{% if documents %}<docs>{% for d in documents %}[{{ loop.index0 }}] {{ d.title }}: {{ d.text }}\n{% endfor %}</docs>{% endif %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")

# A template that reads content parts (Llama 4 / Qwen2-VL style, openai content format).
PARTS_ONLY = ("{% for m in messages %}<{{ m.role }}>{% for part in m['content'] %}{% if part.type == 'text' %}{{ part.text }}{% endif %}"
              "{% endfor %}</{{ m.role }}>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")

GENERATION_TAG = ("{% for m in messages %}{% if m.role == 'assistant' %}<a>{% generation %}{{ m.content }}{% endgeneration %}</a>"
                  "{% else %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endif %}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}")

# Templates that read what transformers always passes: tools and documents (None when not given),
# and a message's reasoning under each of its names (gpt-oss templates read `thinking`).
DEFINED = ("{% if tools is defined %}[tools {{ tools is none }}]{% endif %}{% if documents is defined %}"
           "[documents {{ documents is none }}]{% endif %}{% for m in messages %}<{{ m.role }}>{{ m.content }}"
           "{% if m.thinking is defined %}(thinking: {{ m.thinking }}){% endif %}{% endfor %}")

REAL = {"llama3": LLAMA3, "qwen25": QWEN25, "qwen3": QWEN3, "mixtral": MIXTRAL, "gemma": GEMMA, "gemma3": GEMMA3,
        "phi3": PHI3, "chatml": CHATML, "deepseek_r1": DEEPSEEK_R1, "docs": DOCS, "parts_only": PARTS_ONLY,
        "generation_tag": GENERATION_TAG, "defined": DEFINED}
# Templates that loop over a message's content: vLLM passes them the parts ("openai" format).
READS_PARTS = {"gemma3", "parts_only"}

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <b>now</b> & später",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALLS = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]
DOCUMENTS = [{"title": "Doc A", "text": "alpha"}, {"title": "Doc B", "text": "beta"}]
CONVERSATIONS = {
    "system": [{"role": "system", "content": "You are kind."}, {"role": "user", "content": "Hi there"},
               {"role": "assistant", "content": "Hello! How can I help?"},
               {"role": "user", "content": "Tell me a story 😀 你好 <b>&</b>"}],
    "no_system": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"},
                  {"role": "user", "content": "again"}],
    "parts": [{"role": "system", "content": [{"type": "text", "text": "sys part"}]},
              {"role": "user", "content": [{"type": "text", "text": " one "}, {"type": "text", "text": "two"}]}],
    "empty": [{"role": "user", "content": ""}],
    "tool_calls": [{"role": "user", "content": "Weather in Paris?"},
                   {"role": "assistant", "content": None, "tool_calls": CALLS},
                   {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                   {"role": "tool", "tool_call_id": "call_1",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
    "think": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\n4"},
              {"role": "user", "content": "3+3?"}],
    "reasoning": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning": "add"},
                  {"role": "user", "content": "ok"}],
    "names": [{"role": "user", "content": "hi", "name": "bob"}, {"role": "assistant", "content": "hey"},
              {"role": "user", "content": "x"}],
    "custom_role": [{"role": "user", "content": "hi"}, {"role": "narrator", "content": "meanwhile"}],
}
CONTINUED = {
    "continue": [{"role": "user", "content": "Tell a story"}, {"role": "assistant", "content": "Once upon a"}],
    "continue_spaces": [{"role": "user", "content": "Tell a story"}, {"role": "assistant", "content": "  Once upon a  "}],
    "continue_empty": [{"role": "user", "content": "Tell a story"}, {"role": "assistant", "content": ""}],
    "continue_e": [{"role": "user", "content": "Tell a story"}, {"role": "assistant", "content": "e"}],
}
VARIANTS = {"plain": {}, "no_generation_prompt": {"add_generation_prompt": False}, "tools": {"tools": TOOLS},
            "no_thinking": {"chat_template_kwargs": {"enable_thinking": False}}, "documents": {"documents": DOCUMENTS}}
CASES = [(t, c, v) for t in REAL for c in CONVERSATIONS for v in VARIANTS] + \
        [(t, c, "continue") for t in REAL for c in CONTINUED]
# transformers 5 tokenizes stories260K's legacy sentencepiece text after a special token without the
# second "▁" that tokenizer.json's normalizer adds (" [INST]" after "<s>"): a tokenizer difference,
# not a template one, so ids are compared where no special token is followed by a space.
SPACE_AFTER_SPECIAL = ("<s> ", "</s> ")


def vllm_messages(messages: list[dict], as_parts: bool) -> list[dict]:
    """An OpenAI request's messages as vLLM hands them to transformers (its chat_utils): text parts
    joined by newlines, or kept as {"type": "text"} parts for a template that loops over content;
    no content is "" (or []); tool call arguments parsed; reasoning under both names; a tool's text
    parts joined; names kept."""
    out = []
    for m in messages:
        content = m.get("content")
        texts = [] if content is None else [content] if isinstance(content, str) else [p["text"] for p in content]
        shaped = [{"type": "text", "text": t} for t in texts] if as_parts and m["role"] != "tool" else "\n".join(texts)
        item = {"role": m["role"], "content": shaped}
        if m["role"] == "assistant":
            if m.get("tool_calls"):
                item["tool_calls"] = copy.deepcopy(m["tool_calls"])
                for call in item["tool_calls"]:
                    call["function"]["arguments"] = json.loads(call["function"]["arguments"])
            if m.get("reasoning") is not None:
                item["reasoning"] = item["reasoning_content"] = m["reasoning"]
        elif m["role"] == "tool" and "tool_call_id" in m:
            item["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            item["name"] = m["name"]
        out.append(item)
    return out


def with_template(src: Path, dst: Path, template, jinja_file: bool = False) -> Path:
    """stories260K's tokenizer files (not its weights unless asked by the server) with a chat template."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        shutil.copyfile(f, dst / f.name)
    config = json.loads((src / "tokenizer_config.json").read_text())
    if jinja_file:
        (dst / "chat_template.jinja").write_text(template, encoding="utf-8")
    else:
        config["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def tokenizers_by_template(stories_path, tmp_path_factory):
    """template name -> (minillm Tokenizer, transformers tokenizer), one model directory each
    (every other one with the template in chat_template.jinja)."""
    root = tmp_path_factory.mktemp("templates")
    out = {}
    for i, (name, template) in enumerate(REAL.items()):
        path = with_template(stories_path, root / name, template, jinja_file=i % 2 == 1)
        out[name] = Tokenizer.from_pretrained(path), transformers.AutoTokenizer.from_pretrained(str(path))
    return out


def minillm_render(tok: Tokenizer, body: dict) -> str:
    """The prompt text a chat completion or /tokenize renders for a request body."""
    req = TokenizeChatRequest.model_validate({"model": "m", **body})
    return tok.render_chat(messages_as_dicts(req), None, req.add_generation_prompt, req.continue_final_message,
                           content_parts=True, **template_kwargs(req))


def reference(ref, name: str, body: dict, tokenize: bool = False):
    """transformers' apply_chat_template of the request as vLLM renders it ("error" when it raises)."""
    try:
        return ref.apply_chat_template(
            vllm_messages(body["messages"], name in READS_PARTS), tools=body.get("tools"),
            documents=body.get("documents"), add_generation_prompt=body.get("add_generation_prompt", True),
            continue_final_message=body.get("continue_final_message", False), tokenize=tokenize,
            **({"return_dict": False} if tokenize else {}), **body.get("chat_template_kwargs", {}))
    except Exception:       # the template's raise_exception and the like
        return "error"


def case_body(conversation: str, variant: str) -> dict:
    if variant == "continue":
        return {"messages": CONTINUED[conversation], "add_generation_prompt": False, "continue_final_message": True}
    return {"messages": CONVERSATIONS[conversation], **VARIANTS[variant]}


@pytest.mark.parametrize("template,conversation,variant", CASES)
def test_real_templates_render_what_transformers_renders(tokenizers_by_template, template, conversation, variant):
    """Text and ids of each template, conversation and request variant, against transformers; a
    template's refusal (raise_exception, a role it does not take) is a ValueError (a 400)."""
    tok, ref = tokenizers_by_template[template]
    body = case_body(conversation, variant)
    expected = reference(ref, template, body)
    if expected == "error":
        with pytest.raises(ValueError, match="chat template"):
            minillm_render(tok, body)
        return
    text = minillm_render(tok, body)
    assert text == expected
    ids = tok.encode(text, add_special_tokens=False)
    if not any(s in text for s in SPACE_AFTER_SPECIAL):
        assert ids == list(reference(ref, template, body, tokenize=True))
    if text.startswith("<s>"):
        assert ids[:2] != [1, 1] and ids[0] == 1      # the template's BOS, once


def test_strftime_now_renders_todays_date_as_llama_3_does(tokenizers_by_template):
    tok, _ = tokenizers_by_template["llama3"]
    before = datetime.now()
    text = minillm_render(tok, {"messages": CONVERSATIONS["no_system"]})
    dates = {(before + timedelta(days=d)).strftime("%d %b %Y") for d in (0, 1)}
    assert any(f"Today Date: {d}\n" in text for d in dates), text


def test_continuing_a_final_message_cuts_where_its_text_ends():
    """Phi-3 writes <|end|> and </s> after the message: a final 'e' continued must end at that 'e',
    not inside '<|end|>' (the text was cut after the last 'e' anywhere in what followed it)."""
    from minillm.chat_template import render
    text = render(PHI3, CONTINUED["continue_e"], False, True, {"eos_token": "</s>"})
    assert text == "<|user|>\nTell a story<|end|>\n<|assistant|>\ne"
    empty = render(CHATML, CONTINUED["continue_empty"], False, True, {})
    assert empty == "<|im_start|>user\nTell a story<|im_end|>\n<|im_start|>assistant\n"


# ---- LLM.chat and the named templates of a model ----------------------------------------------------

NAMED = [{"name": "default", "template": CHATML}, {"name": "tool_use", "template": QWEN25}]


@pytest.fixture(scope="module")
def named_model(stories_path, tmp_path_factory):
    """stories260K (weights too) with two named templates, "default" and "tool_use"."""
    return with_template(stories_path, tmp_path_factory.mktemp("named") / "m", NAMED)


def test_a_model_with_named_templates_renders_tool_use_when_tools_are_given(named_model):
    tok, ref = Tokenizer.from_pretrained(named_model), transformers.AutoTokenizer.from_pretrained(str(named_model))
    messages = CONVERSATIONS["no_system"]
    for tools in (None, TOOLS):
        expected = ref.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        assert minillm_render(tok, {"messages": messages, **({"tools": tools} if tools else {})}) == expected
    # A template's name in place of its text picks it, as in transformers (and vLLM's chat_template).
    by_name = ref.apply_chat_template(messages, chat_template="tool_use", add_generation_prompt=True, tokenize=False)
    assert tok.render_chat(messages, "tool_use") == by_name
    assert "You are Qwen" in by_name


@pytest.fixture(scope="module")
def llm(named_model):
    from minillm import LLM
    return LLM(str(named_model), device="cpu")


def test_llm_chat_renders_parts_none_content_and_reasoning_as_vllm_does(llm, tokenizers_by_template):
    """LLM.chat shapes messages as the server does: a content of None is "" (the ChatML template
    concatenates it), parts reach a template that loops over them, reasoning gets every name."""
    from minillm import SamplingParams
    params = SamplingParams(max_tokens=1, temperature=0)
    for name, messages in (("chatml", CONVERSATIONS["tool_calls"]), ("parts_only", CONVERSATIONS["parts"]),
                           ("defined", CONVERSATIONS["reasoning"]), ("gemma3", CONVERSATIONS["parts"])):
        _, ref = tokenizers_by_template[name]
        expected = ref.apply_chat_template(vllm_messages(messages, name in READS_PARTS), add_generation_prompt=True,
                                           tokenize=False)
        [out] = llm.chat(messages, params, chat_template=REAL[name])
        assert out.prompt == expected
    # The model's tool_use template (its tool prompt outgrows stories260K's context: cut for the engine).
    [out] = llm.chat(CONVERSATIONS["no_system"], SamplingParams(max_tokens=1, truncate_prompt_tokens=64), tools=TOOLS)
    assert out.prompt.startswith("<|im_start|>system\nYou are Qwen") and "get_weather" in out.prompt


# ---- the server: /tokenize and chat completions ---------------------------------------------------------

@pytest.fixture(scope="module")
def server(named_model):
    options = ServerOptions(trust_request_chat_template=True)
    with running_server(named_model, options=options) as (url, engine):
        yield url, engine


def tokenize(http, **body) -> httpx.Response:
    return http.post("/tokenize", json={"model": "stories", "messages": CONVERSATIONS["no_system"], **body})


@pytest.mark.parametrize("name", ["docs", "defined", "parts_only", "gemma3", "generation_tag", "qwen3", "llama3"])
def test_tokenize_renders_request_templates_as_transformers(http, tokenizers_by_template, name):
    """/tokenize's ids with a request's chat_template, documents, parts and kwargs: transformers' ids."""
    _, ref = tokenizers_by_template[name]
    body = {"messages": CONVERSATIONS["parts"], "documents": DOCUMENTS, "tools": TOOLS,
            "chat_template_kwargs": {"enable_thinking": False, "date_string": "01 Jan 2025"}}
    response = tokenize(http, chat_template=REAL[name], **body)
    assert response.status_code == 200, response.text
    expected = ref.apply_chat_template(
        vllm_messages(body["messages"], name in READS_PARTS), tools=TOOLS, documents=DOCUMENTS,
        add_generation_prompt=True, tokenize=True, return_dict=False, **body["chat_template_kwargs"])
    assert response.json()["tokens"] == list(expected)


def test_documents_reach_the_template_of_a_chat_completion(http):
    """vLLM's documents field: it was dropped as an unknown field, so a RAG template saw none."""
    body = {"model": "stories", "messages": [{"role": "user", "content": "hi"}], "documents": DOCUMENTS,
            "chat_template": DOCS, "max_tokens": 1, "return_token_ids": True}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    ids = response.json()["prompt_token_ids"]
    assert tokenize(http, messages=body["messages"], documents=DOCUMENTS, chat_template=DOCS).json()["tokens"] == ids
    assert tokenize(http, messages=body["messages"], chat_template=DOCS).json()["tokens"] != ids


@pytest.mark.parametrize("messages,param", [
    ([{"role": "user", "content": [{"type": "text", "text": "hi"},
                                   {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}],
     "messages.0.content.1.type"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}}]}],
     "messages.0.content.0.type"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages.0.content.0.text"),
])
def test_non_text_parts_are_400s_naming_the_part(http, messages, param):
    for path in ("/tokenize", "/v1/chat/completions"):
        openai_error(http.post(path, json={"model": "stories", "messages": messages, "max_tokens": 1}), 400, param)


@pytest.mark.parametrize("template,needle", [
    (GEMMA, "System role not supported"),
    (MIXTRAL, "alternate"),
    ("{{ raise_exception('no ' ~ messages|length) }}", "no 3"),
    ("{{ messages[0].content + 1 }}", "chat template failed"),
    ("{% for %}", "does not compile"),
])
def test_a_template_that_refuses_or_breaks_is_a_400_naming_chat_template(http, template, needle):
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "user", "content": "v"}]
    for path in ("/tokenize", "/v1/chat/completions"):
        error = openai_error(http.post(path, json={"model": "stories", "messages": messages, "chat_template": template,
                                                   "max_tokens": 1}), 400, "chat_template")
        assert needle in error["message"]


@pytest.fixture(scope="module")
def gemma_server(stories_path):
    """A server whose template (--chat-template) is Gemma's, which takes no system turn."""
    with running_server(stories_path, options=ServerOptions(chat_template=GEMMA)) as (url, engine):
        yield url


def test_the_servers_own_template_refusing_is_a_400_naming_messages(gemma_server):
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    for path in ("/tokenize", "/v1/chat/completions"):
        response = httpx.post(f"{gemma_server}{path}", json={"model": "stories", "messages": messages, "max_tokens": 1},
                              timeout=60)
        assert "System role not supported" in openai_error(response, 400, "messages")["message"]
    response = httpx.post(f"{gemma_server}/v1/chat/completions", timeout=60,
                          json={"model": "stories", "messages": messages[1:], "max_tokens": 1})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("template", [
    "",                                                     # renders nothing
    "{% if false %}x{% endif %}",
])
def test_a_template_that_renders_nothing_is_a_400(http, template):
    response = http.post("/v1/chat/completions", json={"model": "stories", "messages": [{"role": "user", "content": "a"}],
                                                         "chat_template": template or " {{- '' -}} ", "max_tokens": 1})
    error = openai_error(response, 400, "messages")
    assert "empty prompt" in error["message"]


def test_a_very_large_template_renders(http):
    filler = "{# " + "padding " * 250_000 + "#}"          # 2 MB of comment around ChatML
    response = tokenize(http, chat_template=filler + CHATML + filler)
    assert response.status_code == 200, response.text[:300]
    assert response.json()["tokens"] == tokenize(http, chat_template=CHATML).json()["tokens"]


RUNAWAY = {
    "nested message loops": "{% for a in messages %}{% for b in messages %}{% for c in messages %}"
                            "{% for d in messages %}{% endfor %}{% endfor %}{% endfor %}{% endfor %}",
    "range past the sandbox": "{% for i in range(10**9) %}x{% endfor %}",
    "string doubling with +": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                              "{% endfor %}{{ ns.s }}",
    "string doubling with ~": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                              "{% endfor %}{{ ns.s }}",
    "exponential macro": "{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    "huge width filter": "{{ 'x' | center(4000000000) }}",
    "huge width method": "{{ 'x'.ljust(4000000000) }}",
    "huge %-format width": "{{ '%4000000000d' % 1 }}",
    "huge format width": "{{ '{:>4000000000}'.format(1) }}",
    "replace everywhere": "{% set s = 'x' * 1000000 %}{{ s | replace('', s) }}",
    "writes forever": "{% set s = 'x' * 10000000 %}{% for i in range(100000) %}{{ s }}{% endfor %}",
    "lorem ipsum": "{{ lipsum(100000) }}",
}


@pytest.mark.parametrize("template", list(RUNAWAY.values()), ids=list(RUNAWAY))
def test_a_runaway_template_is_stopped_by_its_bounds_and_the_server_serves_on(http, template):
    """Loops, calls and filters share a budget of steps; strings and lists built, widths and the
    output have bounds: each of these hung a preprocessing thread or built gigabytes."""
    messages = [{"role": "user", "content": "hi"}] * 100
    response = tokenize(http, messages=messages, chat_template=template)
    error = openai_error(response, 400, "chat_template")
    assert "the template" in error["message"], error
    assert tokenize(http, chat_template=CHATML).status_code == 200


def test_a_render_past_its_deadline_is_stopped(monkeypatch):
    """The deadline is the backstop for work no count sees (here: comparing long strings)."""
    import minillm.chat_template as chat_template
    monkeypatch.setattr(chat_template, "MAX_TEMPLATE_SECONDS", 0.2)
    slow = "{% set s = 'x' * 16000000 %}{% for i in range(100000) %}{% if s == s ~ '' %}{% endif %}{% endfor %}"
    with pytest.raises(chat_template.TemplateLimitError, match="longer than 0.2 s"):
        chat_template.render(slow, [{"role": "user", "content": "hi"}], True, False, {})
    # The thread is not left with a pending timeout: the next render works.
    assert chat_template.render(CHATML, [{"role": "user", "content": "hi"}], True, False, {}).endswith("assistant\n")
    # Nor the interpreter with a pending-exception flag that nothing clears (a timeout withdrawn
    # instead of taken): under it a thread with a trace function loops forever at its next call.
    def traced():
        sys.settrace(lambda frame, event, arg: None)
        try:
            chat_template._strftime_now("%Y")
        finally:
            sys.settrace(None)
    thread = threading.Thread(target=traced, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_chat_completions_with_real_templates_generate(http):
    for name in ("llama3", "qwen3", "deepseek_r1"):
        response = http.post("/v1/chat/completions", json={
            "model": "stories", "messages": CONVERSATIONS["system"], "chat_template": REAL[name], "max_tokens": 2,
            "chat_template_kwargs": {"enable_thinking": False}})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] >= 1
