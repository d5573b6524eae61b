"""Session 81: the forward and drafting cost curves of a shape-choosing scheduler after calibration and after 32 MT-bench
first turns at 16 users (128 tokens, lookup on): found a slow first round at 12 rows pricing every 16-row plain round
(CostCurve returned the end of a falling segment at its start value). bf16, 1 thread. Run from the repo root."""
import asyncio, json, torch, time
from anchorspec.api import load
from anchorspec.decode.fallback import DriftMonitor
from anchorspec.decode.lookup import LookupSettings
from anchorspec.serve.scheduler import BATCH_SHAPES, Scheduler
torch.set_num_threads(1)
engine = load("smollm2-135m-instruct", "checkpoints/smollm2-135m-instruct-eagle3.1", "auto", threads=1, compile="auto")
turns = [json.loads(l)["turns"][0] for l in open("../shared/data/mt_bench/question.jsonl")][:32]
prompts = [engine.encode_chat([{"role": "user", "content": t}]) for t in turns]
m = DriftMonitor()
s = Scheduler(engine, monitor=m, max_running=16, calibrate=False, lookup=LookupSettings(), shapes=BATCH_SHAPES)
s.calibrate()
def dump(tag):
    print(tag, {w: {b: [round(p[0],1), round(1e3*p[1],1)] for b, p in c.points.items()} for w, c in sorted(m.forward.curves.items()) if w in (1,2,3,4,5,16)})
    print(tag, "draft", {k: {b: round(1e3*p[1],1) for b, p in c.points.items()} for k, c in m._drafting.items()})
    print(tag, "t*16", {str(sh.depth)+"/"+str(sh.total_tokens): round(m.threshold_at(16, sh),2) for sh in s.shapes})
dump("cal")
loop = asyncio.new_event_loop()
for ids in prompts: s.submit(ids, 128, 0.0, loop=loop)
while s.running_count or s.waiting_count: s.step()
dump("end")
