# Sourced by the FSDP GPU scripts: the tiny full-width checkpoint ($work/tiny, V3.2 attention
# widths) and a 20000-line word-salad corpus ($work/corpus.txt) they fine-tune on.
[[ -f $work/tiny/config.json ]] || timeout 60 python3 -m flashdsa make-tiny --overwrite "$work/tiny" > "$work/make-tiny.log" 2>&1
python3 -c "
import random; r = random.Random(0); w = 'the a king queen lord speak hear my good sir thou art not what is love'.split()
open('$work/corpus.txt', 'w').write('\n'.join(' '.join(r.choice(w) for _ in range(12)) for _ in range(20000)))"
