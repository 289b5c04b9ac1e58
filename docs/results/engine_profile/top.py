"""Top self-time frames and splash frames by inclusive time of a py-spy raw profile: python top.py FILE."""
import collections, sys
self_t = collections.Counter(); total=0; incl = collections.Counter()
for line in open(sys.argv[1]):
    stack, n = line.rsplit(" ", 1); n = int(n); total += n
    frames = stack.split(";")
    self_t[frames[-1]] += n
    for f in set(frames): incl[f] += n
print("total", total)
for f, n in self_t.most_common(25): print(f"{100*n/total:5.1f}% {f[:150]}")
print("---incl")
for f, n in incl.most_common(70):
    if "splash" in f: print(f"{100*n/total:5.1f}% {f[:150]}")
