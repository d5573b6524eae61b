import json, time, statistics, asyncio, sys
from anchorspec.api import load
from anchorspec.serve.scheduler import Scheduler
from anchorspec.decode.lookup import LookupSettings
engine = load("smollm2-135m-instruct", dtype="auto", threads=1, compile="auto")
print("compiled", engine.target.compiled)
prompts=[json.loads(l)["turns"][0] for l in open("../shared/data/mt_bench/question.jsonl")][:32]
sch = Scheduler(engine, lookup=LookupSettings(), calibrate=False)
t0=time.perf_counter(); sch.calibrate(); print("calibrate s", time.perf_counter()-t0)
for rows in (1,4,16):
    print(rows, {w: round(1000*sch.monitor.forward.between_widths(rows,w),1) for w in (1,2,3,5,9,17)})
orig_cap=sch.chains.cap
log=[]
def cap(rows, found):
    c=orig_cap(rows, found); log.append([rows, max(n for _, n in found), len(found), c, round(1000*sch.monitor.forward.between_widths(rows, c+1),1), round(1000*sch.monitor.forward(rows,1),1), round(1000*(sch.monitor.forward.between_widths(rows, max(n for _, n in found)+1)),1)]); return c
sch.chains.cap=cap
orig_round=sch.decoder.round
rounds=[]
def rnd(items, split=False, **kw):
    r=orig_round(items, split, **kw); rounds.append((r.rows, r.width, r.forward_s)); return r
sch.decoder.round=rnd
async def run():
    sem=asyncio.Semaphore(16)
    async def one(p):
        async with sem:
            h=sch.submit(engine.encode(p, chat=True), 128, 0.0)
            while True:
                k,pl=await h.queue.get()
                if k!="tokens": return pl
    return await asyncio.gather(*(one(p) for p in prompts))
sch.start()
t=time.perf_counter(); outs=asyncio.run(run()); print("wall", time.perf_counter()-t)
sch.stop()
caps=[l for l in log if l[3]>0]
print("rounds", len(rounds), "with chains", len(caps))
for l in caps[:40]: print(l)
wide=[r for r in rounds if r[1]>1]
print("wide rounds (rows,width,ms):", [(a,b,round(c*1000)) for a,b,c in wide[:40]])
plain16=[round(c*1000) for a,b,c in rounds if b==1 and a==16]
print("plain 16-row rounds ms: first", plain16[:8], "median", statistics.median(plain16))
