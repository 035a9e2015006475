"""Qwen2.5-Coder-0.5B-Instruct, a model trained for tool calling, through the official
`openai` SDK against `tessera serve --catalog` (started by tests/tests/qwen_openai.rs)."""

import json
import os
import unittest

import jsonschema
import openai

MODEL = "qwen/qwen2.5-coder-0.5b-instruct"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                      "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}},
                                                     "required": ["timezone"]}}},
]


def client():
    return openai.OpenAI(base_url=os.environ["TESSERA_BASE_URL"], api_key=os.environ["TESSERA_API_KEY"],
                         max_retries=0, _strict_response_validation=True)


class Qwen(unittest.TestCase):
    def test_the_model_chooses_a_call_and_answers_from_its_result(self):
        ask = [{"role": "user", "content": "What is the weather in Paris right now?"}]
        r = client().chat.completions.create(model=MODEL, messages=ask, tools=TOOLS, tool_choice="auto",
                                             temperature=0, max_tokens=100)
        choice = r.choices[0]
        # Nothing forced it: the model chose to call, and chose the right function.
        self.assertEqual(choice.finish_reason, "tool_calls", choice.message)
        call = choice.message.tool_calls[0]
        self.assertEqual(call.function.name, "get_weather")
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, WEATHER)
        self.assertEqual(args["city"], "Paris")
        history = ask + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "It is 22 degrees and sunny."},
        ]
        answer = client().chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                                  temperature=0, max_tokens=60)
        self.assertEqual(answer.choices[0].message.tool_calls, [])
        self.assertIn("22", answer.choices[0].message.content, "the answer uses the call's result")
        alone = client().chat.completions.create(model=MODEL, messages=ask, tools=TOOLS, tool_choice="none",
                                                 max_tokens=1)
        self.assertGreater(answer.usage.prompt_tokens, alone.usage.prompt_tokens + 20, "the call and result are in it")

    def test_json_schema_output(self):
        schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                                   "language": {"enum": ["python", "rust", "go"]},
                                                   "lines": {"type": "integer", "minimum": 1, "maximum": 500}},
                  "required": ["name", "language", "lines"], "additionalProperties": False}
        r = client().chat.completions.create(
            model=MODEL, temperature=0, max_tokens=100,
            messages=[{"role": "user", "content": "Describe a small Python script as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "script", "schema": schema, "strict": True}})
        self.assertEqual(r.choices[0].finish_reason, "stop")
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


if __name__ == "__main__":
    unittest.main(verbosity=2)
