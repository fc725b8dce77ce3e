"""Chat templates of real model families (Qwen2.5 and Qwen3 ChatML with tools and <think>, Llama 3.1 with its date
and tools header, Mistral's [INST] with [AVAILABLE_TOOLS], a grounded-generation template reading documents) rendered
by minillm and by transformers' apply_chat_template from the same model directories, and the ways a directory holds
its templates (a string, a list of named templates, chat_template.jinja and additional_chat_templates/)."""
from __future__ import annotations

import copy
import itertools

import pytest

from test_abuse19_templates import QWEN25, QWEN3
from test_abuse29_tokenizers import save_llama3, save_mistral, save_qwen

transformers = pytest.importorskip("transformers")

LLAMA31 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
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

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
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
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
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

MISTRAL = r"""{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

# Command R / Granite-style grounded generation: documents as a variable of the template.
DOCUMENTS = r"""{{ bos_token }}{% if documents %}<|im_start|>system
Documents:
{% for doc in documents %}[{{ loop.index0 }}] {% for key, value in doc.items() %}{{ key }}: {{ value }}{% if not loop.last %} | {% endif %}{% endfor %}
{% endfor %}<|im_end|>
{% endif %}{% for message in messages %}<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city, «quoted» & <b>",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}]
CALL = {"id": "abcdefghi", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}
CALL_STR = {"id": "abcdefghi", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
DOCS = [{"title": "Paris", "text": "Capital of France."}, {"title": "Tokyo", "text": "東京"}]
CONVERSATIONS = {
    "plain": [{"role": "user", "content": "Hi 日本 😀\n  there "}],
    "system": [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi"},
               {"role": "assistant", "content": "Hello!  "}, {"role": "user", "content": "More"}],
    "final_assistant": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once upon a  "}],
    "tool_calls": [{"role": "system", "content": "Sys"}, {"role": "user", "content": "Weather in Paris?"},
                   {"role": "assistant", "content": None, "tool_calls": [CALL]},
                   {"role": "tool", "tool_call_id": "abcdefghi", "content": "22C"},
                   {"role": "tool", "tool_call_id": "abcdefghi", "content": "sunny"}],
    "tool_call_string_arguments": [{"role": "user", "content": "Weather in Paris?"},
                                   {"role": "assistant", "content": "Let me check.", "tool_calls": [CALL_STR]},
                                   {"role": "tool", "tool_call_id": "abcdefghi", "content": "22C"},
                                   {"role": "assistant", "content": "It is 22C."}, {"role": "user", "content": "thanks"}],
    "thinking": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
                 {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6", "reasoning_content": "add again"}],
    "reasoning_alias": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "thinking": "hmm"}],
    "content_parts": [{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "two"}]}],
}
FAMILIES = {"qwen2.5": (save_qwen, QWEN25, {"qwen3": False}), "qwen3": (save_qwen, QWEN3, {}),
            "llama3.1": (save_llama3, LLAMA31, {}), "mistral": (save_mistral, MISTRAL, {}),
            "documents": (save_qwen, DOCUMENTS, {})}


def _render(tok, conversation, **options):
    """tok's apply_chat_template text, or the type of the error it raised."""
    try:
        return tok.apply_chat_template(copy.deepcopy(conversation), tokenize=False, **options)
    except Exception:       # transformers raises TypeError, TemplateError or ValueError; minillm ValueError
        return "an error"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_templates_render_as_transformers(family, tmp_path):
    """Every conversation with and without a generation prompt, continuing the final message, tools, documents
    and enable_thinking renders to transformers' text (or fails where transformers fails), and to its ids."""
    from minillm.tokenizer import Tokenizer
    save, template, extra = FAMILIES[family]
    path = save(tmp_path / family, template, **extra)
    ref, tok = transformers.AutoTokenizer.from_pretrained(path), Tokenizer.from_pretrained(path)
    for (name, conversation), generation, cont, tools, documents, thinking in itertools.product(
            CONVERSATIONS.items(), (False, True), (False, True), (None, TOOLS), (None, DOCS), (None, True, False)):
        if generation and cont:
            continue
        options = dict(add_generation_prompt=generation, continue_final_message=cont, tools=tools, documents=documents)
        if thinking is not None:
            options["enable_thinking"] = thinking
        text = _render(ref, conversation, **options)
        assert _render(tok, conversation, **options) == text, (name, options)
        if text != "an error":
            ids = ref.apply_chat_template(copy.deepcopy(conversation), tokenize=True, return_dict=False, **options)
            assert tok.apply_chat_template(copy.deepcopy(conversation), **options) == list(ids)


DEFAULT = "{% for m in messages %}D:{{ m.content }}{% endfor %}"
TOOL_USE = "{% for m in messages %}T:{{ m.content }}{% endfor %}{{ tools | length }}"
RAG = "{% for m in messages %}R:{{ m.content }}{% endfor %}"


def _named_layouts(root):
    """Model directories holding named templates each way transformers reads them."""
    layouts = {"config_list": save_qwen(root / "list", [{"name": "default", "template": DEFAULT},
                                                          {"name": "tool_use", "template": TOOL_USE},
                                                          {"name": "rag", "template": RAG}])}
    # transformers' save_pretrained (4.43+, 5): the default in chat_template.jinja, the others one file each
    path = layouts["files"] = save_qwen(root / "files")
    (path / "chat_template.jinja").write_text(DEFAULT)
    (path / "additional_chat_templates").mkdir()
    (path / "additional_chat_templates" / "tool_use.jinja").write_text(TOOL_USE)
    (path / "additional_chat_templates" / "rag.jinja").write_text(RAG)
    path = layouts["files_without_default"] = save_qwen(root / "no_default")
    (path / "additional_chat_templates").mkdir()
    (path / "additional_chat_templates" / "tool_use.jinja").write_text(TOOL_USE)
    # template files win over tokenizer_config.json's templates, all of them
    path = layouts["files_over_config"] = save_qwen(root / "over", [{"name": "default", "template": "{{ 'CONFIG' }}"},
                                                                     {"name": "tool_use", "template": "{{ 'TOOL' }}"}])
    (path / "additional_chat_templates").mkdir()
    (path / "additional_chat_templates" / "rag.jinja").write_text(RAG)
    path = layouts["jinja_over_config"] = save_qwen(root / "jinja", "{{ 'CONFIG' }}")
    (path / "chat_template.jinja").write_text(DEFAULT)
    return layouts


def test_named_templates_are_read_as_transformers_reads_them(tmp_path):
    """The default, "tool_use" when tools are given, and a template asked for by name come from the same place as
    transformers' (additional_chat_templates/ was not read: tool_use and rag were lost)."""
    from minillm.tokenizer import Tokenizer
    conversation = [{"role": "user", "content": "x"}]
    for layout, path in _named_layouts(tmp_path).items():
        ref, tok = transformers.AutoTokenizer.from_pretrained(path), Tokenizer.from_pretrained(path)
        for options in ({}, {"tools": [TOOLS[0]]}, {"chat_template": "rag"}, {"chat_template": "tool_use",
                                                                             "tools": TOOLS}):
            assert _render(tok, conversation, **options) == _render(ref, conversation, **options), (layout, options)


def get_weather(city: str, unit: str = "c"):
    """Weather in a city.

    Args:
        city: The city.
        unit: c or f.
    """


def test_python_functions_as_tools(tmp_path):
    """apply_chat_template takes Python functions as tools, turned into their JSON schemas as transformers turns
    them (they failed to render: "Object of type function is not JSON serializable"); anything but a dict or a
    function is a ValueError naming it."""
    from minillm.tokenizer import Tokenizer
    path = save_qwen(tmp_path / "qwen", QWEN25, qwen3=False)
    ref, tok = transformers.AutoTokenizer.from_pretrained(path), Tokenizer.from_pretrained(path)
    conversation = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(conversation, tools=[get_weather, TOOLS[0]], tokenize=False) == \
        ref.apply_chat_template(conversation, tools=[get_weather, TOOLS[0]], tokenize=False)
    with pytest.raises(ValueError, match=r"tools\[1\]"):
        tok.apply_chat_template(conversation, tools=[TOOLS[0], "get_weather"], tokenize=False)
