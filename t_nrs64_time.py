from common import *
from hf_vkv.default_model import load_default_model
model, tok = load_default_model()
inputs = tok(["The capital of France is"], return_tensors="pt")
for impl in [None, "vkv", None, "vkv"]:
    k = {"cache_implementation": impl} if impl else {}
    torch.manual_seed(1); t = time.time()
    o = model.generate(**inputs, max_new_tokens=8, do_sample=True, num_return_sequences=64, **k)
    print(impl, "nrs64 time", round(time.time()-t, 2), flush=True)
