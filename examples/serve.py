"""`make serve`: MAX's own OpenAI-compatible server with a mokv KV cache, on the CPU.

Writes a tiny random-weight Llama (`mokv_graphs.TINY_LLAMA`, float32) as a Hugging Face
checkpoint if it is not there yet, prints how to ask it, then runs `mokv serve` in the
foreground (Ctrl-C stops it). The first start compiles the model (minutes); later ones
take about 30 s.

    python examples/serve.py [--model-dir .serve/tiny-llama] [--port 8000] [--mokv-config FILE]
"""

import argparse
import os
import sys

import mokv_graphs as mg

SERVE_ARGS = ["--devices", "cpu", "--quantization-encoding", "float32", "--max-length", "1024",
              "--max-batch-size", "2", "--enable-prefix-caching"]

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model-dir", default=".serve/tiny-llama")
parser.add_argument("--port", type=int, default=8000)
parser.add_argument("--mokv-config", help="mokv's tiers, events and sessions (docs/serve.md)")
args = parser.parse_args()

model = mg.tiny_llama_checkpoint(args.model_dir)
url = f"http://127.0.0.1:{args.port}"
print(f"""mokv serve: {model} on {url} (OpenAI API at {url}/v1), once it says "Server ready".

Ask it with token ids (token i is the word "t<i>"):
  curl -s {url}/v1/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "prompt": [1, 17, 42, 99], "max_tokens": 8}}'

  from openai import OpenAI
  client = OpenAI(base_url="{url}/v1", api_key="-")
  reply = client.completions.create(model="{model}", prompt=[1, 17, 42, 99], max_tokens=8)
  print(reply.choices[0].text, reply.usage.prompt_tokens_details.cached_tokens)
""", flush=True)
command = [sys.executable, "-m", "mokv.pipelines.serve", "serve", "--model", str(model),
           *SERVE_ARGS, "--host", "127.0.0.1", "--port", str(args.port)]
if args.mokv_config:
    command += ["--mokv-config", args.mokv_config]
# A local demo: no model hub, and no usage telemetry sent from it (MAX's default sends it).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MAX_SERVE_DISABLE_TELEMETRY", "1")
os.execv(sys.executable, command)
