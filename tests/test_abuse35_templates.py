"""Chat templates as models ship them (Llama 3.2, Gemma 3, Granite 3.3, DeepSeek-R1-Distill, Phi-4-mini as llama.cpp
keeps it, SmolLM2, Qwen3) rendered by the server from OpenAI requests, byte for byte as vLLM renders them: its shaping of the
messages (content parts joined or kept, empty text parts, tool results, None content beside tool calls) handed to
transformers' apply_chat_template."""
from __future__ import annotations

import copy
import json

import httpx
import pytest
from test_abuse19_templates import LLAMA3 as LLAMA32, QWEN3   # LLAMA3 there is Llama 3.2's template
from test_server_helpers import running_server

from minillm.chat_template import reads_content_parts
from minillm.server.app import ServerOptions

transformers = pytest.importorskip("transformers")

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
            {%- if item['type'] == 'audio' -%}
                {{ '<audio_soft_token>' }}
            {%- elif item['type'] == 'image' -%}
                {{ '<image_soft_token>' }}
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

PHI4_MINI = r"""{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
{% elif tools is defined -%}
    {%- set system_message = "" -%}
{%- endif %}

{%- if system_message is defined -%}
    {{- '<|system|>' + system_message -}}
    {%- if tools is defined -%}
        {% for tool in tools %}
            {{- '<|tool|>' + (tool['function'] | tojson) + '<|/tool|>' -}}
        {% endfor %}
        {%- if '<|tool_call|>' not in system_message -%}
            {{- 'You are a helpful assistant with some tools.\nTo use a tool, respond in this format: <|tool_call|>{"name": "foo", "arguments": {"a": 1}}<|/tool_call|>' -}}
        {%- endif -%}
    {%- endif -%}
    {{- '<|end|>' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message['role'] == 'tool' -%}
        {{- '<|tool_response|>' + (message['content'] | tojson) + '<|end|>' -}}
    {%- elif message['role'] != 'system' -%}
        {{- '<|' + message['role'] + '|>' -}}
        {%- if message.content -%}
            {{- message['content'] -}}
        {%- endif -%}  
        {%- for tool_call in message.tool_calls -%}
            {{- '<|tool_call|>' + (tool_call['function'] | tojson) + '<|/tool_call|>' -}}
        {%- endfor -%}
        {{- '<|end|>' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
   {{- '<|assistant|>' -}}
{%- else -%}
   {{- eos_token -}}
{%- endif -%}"""

GRANITE33 = r"""{# Alias tools -> available_tools #}
{%- if tools and not available_tools -%}
    {%- set available_tools = tools -%}
{%- endif -%}
{%- if messages[0]['role'] == 'system' %}
     {%- set system_message = messages[0]['content'] %}
     {%- set loop_messages = messages[1:] %}
 {%- else %}
     {%- set system_message = "Knowledge Cutoff Date: April 2024. Today's Date: " + strftime_now('%B %d, %Y') + ". You are Granite, developed by IBM." %}
     {%- if available_tools and documents %}
         {%- set system_message = system_message + " You are a helpful assistant with access to the following tools. When a tool is required to answer the user's query, respond only with <|tool_call|> followed by a JSON list of tools used." %}
     {%- elif available_tools %}
         {%- set system_message = system_message + " You are a helpful assistant with access to the following tools. When a tool is required to answer the user's query, respond only with <|tool_call|> followed by a JSON list of tools used. If a tool does not exist in the provided list of tools, notify the user that you do not have the ability to fulfill the request." %}
     {%- elif documents %}
         {%- set system_message = system_message + " Write the response to the user's input by strictly aligning with the facts in the provided documents." %}
    {%- elif thinking %}
    {%- set system_message = system_message + " You are a helpful AI assistant.
Respond to every user query in a comprehensive and detailed way. Write your thoughts between <think></think> and write your response between <response></response> for each user query." %}
     {%- else %}
         {%- set system_message = system_message + " You are a helpful AI assistant." %}
     {%- endif %}
     {%- if 'citations' in controls and documents %}
         {%- set system_message = system_message + '
Use the symbols <|start_of_cite|> and <|end_of_cite|> to indicate when a fact comes from a document in the search result.' %}
     {%- endif %}
     {%- if 'hallucinations' in controls and documents %}
         {%- set system_message = system_message + '
Finally, after the response is written, include a numbered list of sentences from the response with a corresponding risk value that are hallucinated and not based in the documents.' %}
     {%- endif %}
     {%- set loop_messages = messages %}
 {%- endif %}
 {{- '<|start_of_role|>system<|end_of_role|>' + system_message + '<|end_of_text|>
' }}
 {%- if available_tools %}
     {{- '<|start_of_role|>available_tools<|end_of_role|>' }}
     {{- available_tools | tojson(indent=4) }}
     {{- '<|end_of_text|>
' }}
 {%- endif %}
 {%- if documents %}
     {%- for document in documents %}
         {{- '<|start_of_role|>document {"document_id": "' + document['doc_id'] | string + '"}<|end_of_role|>
' }}
         {{- document['text'] }}
         {{- '<|end_of_text|>
' }}
              {%- endfor %}
 {%- endif %}
 {%- for message in loop_messages %}
     {{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] + '<|end_of_text|>
' }}
     {%- if loop.last and add_generation_prompt %}
         {{- '<|start_of_role|>assistant' }}
             {%- if controls %}
                 {{- ' ' + controls | tojson()}}
             {%- endif %}
         {{- '<|end_of_role|>' }}
     {%- endif %}
 {%- endfor %}
"""

R1_DISTILL = r"""{% if not add_generation_prompt is defined -%}
  {%- set add_generation_prompt = false -%}
{%- endif -%}
{%- set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='') -%}
{%- for message in messages -%}
  {%- if message['role'] == 'system' -%}
    {%- set ns.system_prompt = message['content'] -%}
  {%- endif -%}
{%- endfor -%}{{bos_token}}{{ns.system_prompt}}
{%- for message in messages -%}
  {%- if message['role'] == 'user' -%}
    {%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}
  {%- endif -%}
  {%- if message['role'] == 'assistant' and message['tool_calls'] -%}
    {%- set ns.is_tool = false -%}
    {%- for tool in message['tool_calls']-%}
      {%- if not ns.is_first -%}
        {{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}
        {%- set ns.is_first = true -%}
      {%- else -%}
        {{'\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}
      {%- endif -%}
    {%- endfor -%}
    {{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}
  {%- endif -%}
  {%- if message['role'] == 'assistant' and message['content'] is not none -%}
    {%- if ns.is_tool -%}{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}
      {%- set ns.is_tool = false -%}
    {%- else -%}
      {%- set content = message['content'] -%}
      {%- if '</think>' in content -%}
        {%- set content = content.split('</think>')[-1] -%}
      {%- endif -%}{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}
    {%- endif -%}
  {%- endif -%}
  {%- if message['role'] == 'tool' -%}
    {%- set ns.is_tool = true -%}
    {%- if ns.is_output_first -%}{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}
      {%- set ns.is_output_first = false -%}
      {%- else -%}{{'\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}
    {%- endif -%}
  {%- endif -%}
{%- endfor -%}
{%- if ns.is_tool -%}{{'<｜tool▁outputs▁end｜>'}}
{%- endif -%}
{%- if add_generation_prompt and not ns.is_tool -%}{{'<｜Assistant｜><think>\n'}}
{%- endif %}"""

SMOLLM2 = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"

TEMPLATES = {"llama3.2": LLAMA32, "gemma3": GEMMA3, "granite3.3": GRANITE33, "r1-distill": R1_DISTILL,
             "phi4-mini": PHI4_MINI, "smollm2": SMOLLM2, "qwen3": QWEN3}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather «é» & <b>", "strict": True,
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "noargs"}}]
CALL = {"id": "abcdefghi", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATIONS = {
    "system_user": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 日本", "name": "alice"}],
    "prefill": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [{"type": "text", "text": "Once"},
                                                                                     {"type": "text", "text": "upon "}]}],
    "tool_results": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                     {"role": "tool", "tool_call_id": "abcdefghi", "content": [{"type": "text", "text": ""},
                                                                                {"type": "text", "text": "22C"}]}],
    "empty_parts": [{"role": "user", "content": [{"type": "text", "text": ""}, "a", {"type": "text", "text": "b"}]},
                    {"role": "assistant", "content": "", "reasoning": "hmm"}, {"role": "user", "content": ""}],
}
REQUESTS = [{}, {"add_generation_prompt": False, "continue_final_message": True}, {"tools": TOOLS},
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
            {"chat_template_kwargs": {"enable_thinking": False, "thinking": True}}]


def vllm_messages(messages: list[dict], as_parts: bool) -> list[dict]:
    """Messages of a request as vLLM's parse_chat_messages hands them to the template (text-only content)."""
    out = []
    for message in copy.deepcopy(messages):
        content = message.get("content")
        texts = [] if content is None else [content] if isinstance(content, str) else \
            [p if isinstance(p, str) else p["text"] for p in content]
        shaped = [{"type": "text", "text": t} for t in texts] if as_parts else "\n".join(t for t in texts if t)
        if message["role"] == "tool" and isinstance(shaped, list):
            shaped = "\n".join(part["text"] for part in shaped)
        item = {"role": message["role"], "content": shaped}
        if message["role"] == "assistant" and message.get("tool_calls"):
            item["tool_calls"] = message["tool_calls"]
            for call in item["tool_calls"]:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"] or "{}")
        if message["role"] == "assistant" and message.get("reasoning") is not None:
            item["reasoning"] = item["reasoning_content"] = message["reasoning"]
        for key in ("tool_call_id", "name"):
            if key in message:
                item[key] = message[key]
        out.append(item)
    return out


def vllm_render(ref, template: str, messages: list[dict], request: dict) -> str | None:
    """transformers' text for the request as vLLM renders it (its tools as model_dump writes them); None where it fails."""
    tools = [{"type": "function", "function": {"name": t["function"]["name"], "description": None, "parameters": None,
                                               **t["function"]}} for t in request.get("tools", [])] or None
    try:
        return ref.apply_chat_template(
            vllm_messages(messages, reads_content_parts(template)), tools=tools, chat_template=template, tokenize=False,
            add_generation_prompt=request.get("add_generation_prompt", True),
            continue_final_message=request.get("continue_final_message", False), **request.get("chat_template_kwargs", {}))
    except Exception:       # transformers raises TemplateError, TypeError or ValueError; the server a 400
        return None


@pytest.fixture(scope="module")
def served(stories_path, tmp_path_factory):
    """(url, transformers tokenizer): stories260K with room for long prompts, rendering each request's own template."""
    model = tmp_path_factory.mktemp("long_stories")
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (model / name).symlink_to(stories_path / name)
    config = json.loads((stories_path / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8192}))
    options = ServerOptions(trust_request_chat_template=True, tool_call_parser="hermes")
    with running_server(model, max_model_len=8192, options=options) as (url, _):
        yield url, transformers.AutoTokenizer.from_pretrained(model)


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_real_templates_render_as_vllm_renders_them(served, family):
    url, ref = served
    template, rendered = TEMPLATES[family], 0
    for (name, messages) in CONVERSATIONS.items():
        for request in REQUESTS:
            expected = vllm_render(ref, template, messages, request)
            response = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
                "model": "stories", "messages": messages, "max_tokens": 1, "return_prompt_text": True,
                "chat_template": template, **request})
            if expected is None:
                assert response.status_code == 400, (name, request, response.text)
                continue
            assert response.status_code == 200, (name, request, response.text)
            assert response.json()["prompt_text"] == expected, (name, request)
            rendered += 1
    assert rendered >= 8          # most requests render: the comparison is not of two errors


@pytest.mark.parametrize("content_format, user, tool", [
    ("string", "a\nb", "22C"),                                  # empty parts left out, as vLLM's string format drops them
    ("openai", "[|a|b]", "\n22C"),                              # kept as parts; a tool's parts joined whole
])
def test_empty_text_parts_are_shaped_as_vllm_shapes_them(tok, content_format, user, tool):
    # The string format joined every part: "\na\nb" and "\n22C", where vLLM renders "a\nb" and "22C".
    template = ("{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}"
                "[{% for p in m.content %}{{ p.text }}{% if not loop.last %}|{% endif %}{% endfor %}]{% endif %}/{% endfor %}")
    messages = [{"role": "user", "content": [{"type": "text", "text": ""}, {"type": "text", "text": "a"},
                                             {"type": "text", "text": "b"}]},
                {"role": "tool", "content": [{"type": "text", "text": ""}, {"type": "text", "text": "22C"}]}]
    text = tok.render_chat(messages, template, add_generation_prompt=False, content_parts=content_format)
    assert text == f"{user}/{tool}/"
