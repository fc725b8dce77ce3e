"""vLLM-style scripts against LLM on the CPU: outputs and errors as vLLM's users read them."""
from __future__ import annotations

from minillm import SamplingParams
from minillm.sampling_params import StructuredOutputsParams


def test_text_cut_inside_a_character_keeps_the_character_before_it(llm):
    """max_tokens ending inside a byte-fallback character after a whole one: '日' then one '\ufffd'
    for the lone byte (the final decode replaced '日' too and gave '日\ufffd\ufffd\ufffd')."""
    params = SamplingParams(max_tokens=10, structured_outputs=StructuredOutputsParams(choice=["€ café 日本"]))
    out = llm.generate("Price:", params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[-4:] == [233, 154, 168, 233]       # <0xE6> <0x97> <0xA5> (日), <0xE6>
    assert out.text == "€ café 日\ufffd"


def test_vllm_top_level_names_import():
    """`from vllm import LLM, PromptType, ...` reads `from minillm import ...` (PromptType was missing)."""
    import minillm
    from minillm import PromptType
    from minillm.prompts import PromptType as defined
    assert PromptType is defined
    for name in minillm.__all__:
        getattr(minillm, name)


def test_chat_template_kwargs_set_chat_arguments_over_them(llm):
    """vLLM's LLM.chat merges chat_template_kwargs over chat_template, add_generation_prompt and
    continue_final_message (they were a ValueError)."""
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}" \
               "{% if add_generation_prompt %}assistant:{% endif %}"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once"}]
    params = SamplingParams(max_tokens=1, temperature=0)

    def prompt(**kwargs):
        return llm.chat(messages, params, use_tqdm=False, **kwargs)[0].prompt

    assert prompt(chat_template="x", chat_template_kwargs={"chat_template": template}) == prompt(chat_template=template)
    assert prompt(chat_template=template, chat_template_kwargs={"add_generation_prompt": False}) == \
        "user: hi\nassistant: Once\n"
    assert prompt(chat_template=template, chat_template_kwargs={"add_generation_prompt": False,
                                                                 "continue_final_message": True}) == \
        "user: hi\nassistant: Once"
