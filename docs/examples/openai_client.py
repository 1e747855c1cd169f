"""The official `openai` client against `asyncengine serve`.

asyncengine serve default --port 8000 --api-key sk-local &
python docs/examples/openai_client.py

For `asyncengine serve path/to/my-model`, pass the served name: the folder's name
(`python docs/examples/openai_client.py my-model`), or the server's --served-model-name.
"""

from __future__ import annotations

import sys

from openai import OpenAI

model = sys.argv[1] if len(sys.argv) > 1 else "default"
client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="sk-local")

completion = client.completions.create(model=model, prompt="Paris is", max_tokens=16)
print(completion.choices[0].text)

stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Write a haiku about the sea."}],
    max_tokens=64,
    stream=True,
    stream_options={"include_usage": True},
)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
    if chunk.usage is not None:
        print(f"\n[{chunk.usage.completion_tokens} tokens]")
