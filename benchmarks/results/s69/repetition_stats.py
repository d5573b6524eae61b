import numpy as np, sys, glob
def runs(tokens, loss, min_match=2, max_match=8, k=16):
    # for each answer position t: the lookup's proposal from the most recent earlier occurrence of the longest suffix
    out=[]
    T=len(tokens)
    ans=np.nonzero(loss)[0]
    if len(ans)==0: return out
    start=ans[0]
    toks=tokens.tolist()
    # index: n-gram -> last position (end index) seen
    for t in range(start, T):
        best=None
        for m in range(min(max_match,t), min_match-1, -1):
            key=tuple(toks[t-m:t])
            # search most recent earlier occurrence ending before t
            j=None
            for e in range(t-1, m-1, -1):
                if toks[e-m:e]==list(key): j=e; break
            if j is not None: best=(m,j); break
        if best is None: out.append(-1); continue
        m,j=best
        n=0
        while n<k and j+n<t and t+n<T and toks[j+n]==toks[t+n]: n+=1
        out.append(n)
    return out
folder=sys.argv[1]; parts=sys.argv[2].split(',') ; limit=int(sys.argv[3])
allr=[]
for p in parts:
    z=np.load(f'{folder}/part-{p}.npz'); off=z['offsets']; tok=z['tokens']; loss=z['loss']
    for i in range(min(limit,len(off)-1)):
        a,b=off[i],off[i+1]
        allr+=runs(tok[a:b].astype(np.int64), loss[a:b])
r=np.array(allr); print(folder, 'positions',len(r),'no match',np.mean(r<0).round(3), ' >=1',np.mean(r>=1).round(3),' >=2',np.mean(r>=2).round(3),' >=4',np.mean(r>=4).round(3),' >=8',np.mean(r>=8).round(3))
# greedy simulation: lookup-only decoding tau
