#!/usr/bin/env bash
# The shipped drafter for SmolLM2-135M-Instruct, end to end. Every step resumes where it stopped:
# rerun the same command after an interruption (or in a later session with the same DATA/RUN folders).
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-data/smollm2-bf16-greedy}
RUN=${RUN:-runs/drafter-smollm2-v6}
STEPS=${STEPS:-2800}
STOP=${STOP:-2600}  # v6's export; the last 200 steps (learning rate near its 1e-4 floor) were left to measurements
VOCAB=${VOCAB:-8192}
# leg 3 (v7): a second dataset (training prompts drawn with seed 1) and a fresh learning-rate cycle from v6
DATA3=${DATA3:-data/smollm2-bf16-greedy-s1}
RUN3=${RUN3:-runs/drafter-smollm2-v7}
STEPS3=${STEPS3:-2600}
STOP3=${STOP3:-2250}  # v7's export (learning rate near its floor by then)
# leg 4 (v8): a third dataset, the target's responses sampled at T = 1 (seed-2 prompts: new continuations of
# the prompts the greedy data already answered), trained on together with the second one, a fresh cycle from v7
DATA4=${DATA4:-data/smollm2-bf16-t1-s2}
RUN4=${RUN4:-runs/drafter-smollm2-v8}
STEPS4=${STEPS4:-2100}
STOP4=${STOP4:-2100}
# leg 5 (v9): multi-turn data: first turns to 2,400 training prompts drawn with seed 3, then a second user turn
# of our own after each of those answers (make-data --follow-up), trained on together, a fresh cycle from v8
DATA5=${DATA5:-data/smollm2-bf16-greedy-s3}
DATA5F=${DATA5F:-data/smollm2-bf16-followup-s3}
RUN5=${RUN5:-runs/drafter-smollm2-v9}
STEPS5=${STEPS5:-1100}
STOP5=${STOP5:-1100}
# leg 6 (v11): no new data: legs 1, 3 and 5's datasets together, the loss weighted toward the first block
# positions (--gamma 3: where a drafter accepted ~2 tokens a round decides its rounds), a short cycle from v9
RUN6=${RUN6:-runs/drafter-smollm2-v11}
STEPS6=${STEPS6:-600}
# leg 7 (v12): blocks of 8 (7 drafted positions) in place of 16: at the ~2 tokens a round these drafters commit,
# positions 8-15 almost never count, and half the block rows halve the drafter pass (docs/training.md); all five
# datasets, twice the anchors per sequence (the same block rows per step)
RUN7=${RUN7:-runs/drafter-smollm2-v12}
STEPS7=${STEPS7:-1500}
# leg 9 (v14): two new datasets, greedy responses to the training prompts drawn with seed 5 and responses sampled
# at T = 1 to those drawn with seed 4, trained on together from v12 (sampled responses alone lost greedy
# acceptance: docs/training.md, leg 8)
DATA9=${DATA9:-data/smollm2-bf16-greedy-s5}
DATA9T=${DATA9T:-data/smollm2-bf16-t1-s4}
RUN9=${RUN9:-runs/drafter-smollm2-v14}
STEPS9=${STEPS9:-1500}
# leg 10 (v15): a third layer grown from v14 (it starts as v14 exactly), trained on leg 9's datasets
RUN10=${RUN10:-runs/drafter-smollm2-v15}
STEPS10=${STEPS10:-1600}
# leg 12 (v17): v15 continued on leg 9's datasets with half its loss the KL to the target's distributions over the
# draft vocabulary (--kl-weight 0.5), a short cosine cycle at half leg 10's peak (leg 11, the same without KL, was
# not shipped)
RUN12=${RUN12:-runs/drafter-smollm2-v17}
STEPS12=${STEPS12:-1000}
# leg 14 (v19): v17 continued the same way on two datasets it has not seen: greedy responses to the training
# prompts drawn with seed 6 and responses sampled at T = 1 to 2,500 prompts drawn with seed 7
DATA14=${DATA14:-data/smollm2-bf16-greedy-s6}
DATA14T=${DATA14T:-data/smollm2-bf16-t1-s7}
RUN14=${RUN14:-runs/drafter-smollm2-v19}
STEPS14=${STEPS14:-1000}
# leg 16 (v21): v19 continued the same way on chat instructions of other kinds (make-data --prompts
# instructions: greedy answers to the family drawn with seed 10, answers sampled at T = 1 to 1,500 drawn with
# seed 11) beside greedy responses to the training prompts drawn with seed 8 and answers sampled at T = 1 to
# 1,000 drawn with seed 9
DATA16I=${DATA16I:-data/smollm2-bf16-instr-s10}
DATA16IT=${DATA16IT:-data/smollm2-bf16-instr-t1-s11}
DATA16=${DATA16:-data/smollm2-bf16-greedy-s8}
DATA16T=${DATA16T:-data/smollm2-bf16-t1-s9}
RUN16=${RUN16:-runs/drafter-smollm2-v21}
STEPS16=${STEPS16:-900}
# leg 17 (v22): v21 continued on new instructions (seed 12), a second turn of our own after each of leg 16's
# greedy instruction answers, and the seed-8 greedy data
DATA17I=${DATA17I:-data/smollm2-bf16-instr-s12}
DATA17F=${DATA17F:-data/smollm2-bf16-instr-followup-s12}
RUN17=${RUN17:-runs/drafter-smollm2-v22}
STEPS17=${STEPS17:-600}
# leg 18 (v23): v22 continued for longer on legs 16 and 17's six datasets at once (no new data)
RUN18=${RUN18:-runs/drafter-smollm2-v23}
STEPS18=${STEPS18:-1600}
# leg 19 (v24, not shipped on its own): v23 continued on new instructions (seed 13), a second turn after each of
# leg 17's instruction answers, leg 17's second turns and the seed-8 data
DATA19I=${DATA19I:-data/smollm2-bf16-instr-s13}
DATA19F=${DATA19F:-data/smollm2-bf16-instr-followup-s13}
RUN19=${RUN19:-runs/drafter-smollm2-v24}
STEPS19=${STEPS19:-900}
# leg 20 (v25): v24 continued on every dataset of legs 16-19 at once, the seed-8 data (code and math) listed twice
RUN20=${RUN20:-runs/drafter-smollm2-v25}
STEPS20=${STEPS20:-1500}
# leg 25 (v30): v25 grown to 4 layers, on chat prompts the target writes itself (seed 17), instructions (seed
# 16) and the training prompts drawn with seed 15 (listed twice), a 4,000-step cosine cycle
DATA25S=${DATA25S:-data/smollm2-bf16-self-s17}
DATA25I=${DATA25I:-data/smollm2-bf16-instr-s16}
DATA25=${DATA25:-data/smollm2-bf16-greedy-s15}
RUN25=${RUN25:-runs/drafter-smollm2-v30-4l}
STEPS25=${STEPS25:-4000}
# leg 26 (v31): v30 continued on requests for prose the target writes itself (seed 18, twelve leads such as
# "Write a letter"; listed twice) with leg 25's chat and instructions, a 2,000-step cycle
DATA26W=${DATA26W:-data/smollm2-bf16-write-s18}
RUN26=${RUN26:-runs/drafter-smollm2-v31-write}
LEADS26="Write a blog post|Write an email|Write a short story|Write a letter|Write a poem|Write an essay|Write a speech"
LEADS26+="|Write a product description|Write a review|Write a dialogue|Draft a|Compose a"
# leg 27 (v32): v31 continued on that prose (twice), leg 25's chat and instructions and the seed-15 data (twice)
RUN27=${RUN27:-runs/drafter-smollm2-v32-mix}
CLI=.venv/bin/castspec

# 1. data: greedy bf16 responses of the target (bf16 is what decoding serves here), decoded in continuous batches
#    over castspec's own rounds (v6's data came from an earlier batched torch decoder: the same target, a few
#    near-tie tokens apart)
if [ "${SKIP_DATA:-0}" != 1 ]; then
  $CLI make-data --out "$DATA" --batch-size 24
  $CLI make-data --out "$DATA3" --batch-size 24 --seed 1
  $CLI make-data --out "$DATA4" --batch-size 24 --seed 2 --temperature 1.0
  $CLI make-data --out "$DATA5" --batch-size 24 --seed 3 --max-prompts 2400
  $CLI make-data --out "$DATA5F" --batch-size 24 --seed 3 --follow-up "$DATA5"
  $CLI make-data --out "$DATA9" --batch-size 24 --seed 5
  $CLI make-data --out "$DATA9T" --batch-size 24 --seed 4 --temperature 1.0
  $CLI make-data --out "$DATA14" --batch-size 24 --seed 6
  $CLI make-data --out "$DATA14T" --batch-size 24 --seed 7 --temperature 1.0 --max-prompts 2500
  $CLI make-data --out "$DATA16I" --batch-size 24 --seed 10 --prompts instructions
  $CLI make-data --out "$DATA16IT" --batch-size 24 --seed 11 --prompts instructions --temperature 1.0 --max-prompts 1500
  $CLI make-data --out "$DATA16" --batch-size 24 --seed 8
  $CLI make-data --out "$DATA16T" --batch-size 24 --seed 9 --temperature 1.0 --max-prompts 1000
  $CLI make-data --out "$DATA17I" --batch-size 24 --seed 12 --prompts instructions
  $CLI make-data --out "$DATA17F" --batch-size 24 --seed 12 --follow-up "$DATA16I"
  $CLI make-data --out "$DATA19I" --batch-size 24 --seed 13 --prompts instructions
  $CLI make-data --out "$DATA19F" --batch-size 24 --seed 13 --follow-up "$DATA17I"
  $CLI make-data --out "$DATA25S" --batch-size 24 --seed 17 --prompts self
  $CLI make-data --out "$DATA25I" --batch-size 24 --seed 16 --prompts instructions
  $CLI make-data --out "$DATA25" --batch-size 24 --seed 15
  $CLI make-data --out "$DATA26W" --prompts self --self-lead "$LEADS26" --seed 18 --batch-size 24
fi
# 2. training: 2 layers from random init with norms at 1 (the public start), 2 sequences x 64 blocks per step,
#    and a short-context curriculum: blocks see only the last 8 context rows for 200 steps, the last 64 until
#    step 450, then everything (docs/training.md says why). Checkpoint every 25 steps; replay R on 4 held-out
#    prompts per domain at every export (RUN/curve.json).
#    The shipped run was trained in two legs, which this reproduces exactly (resume is exact): 800 steps with
#    the cosine schedule of an 800-step run (shipped on its own for a while as v5, docs/training.md), then
#    resumed with --steps $STEPS, which puts the learning rate back on the longer schedule (1e-4 -> 8.5e-4 at
#    step 800) and continues the data order where it stopped.
TRAIN="$CLI train-drafter --data $DATA --out $RUN --layers 2 --seqs-per-step 2 --anchors 64 --lr 1e-3
       --norm-init ones --context-window 8:200,64:450 --checkpoint-every 25 --export-every 100 --eval-per-domain 4"
$TRAIN --steps 800
$TRAIN --steps "$STEPS" --stop-after "$STOP"
# 3. the draft vocabulary (the VOCAB tokens the target writes most: a 6x cheaper drafter head, docs/training.md)
$CLI draft-vocab --drafter "$RUN/drafter" --data "$DATA" --size "$VOCAB"
# 4. leg 3: warm start from v6 on the second dataset, the loss over the draft vocabulary (as decoding scores
#    it; a cheaper step), a fresh cosine cycle, 4 sequences per step; no curriculum (v6 is past it)
$CLI train-drafter --data "$DATA3" --out "$RUN3" --layers 2 --seqs-per-step 4 --anchors 64 --lr 6e-4 \
    --norm-init ones --init-from "$RUN/drafter" --draft-vocab "$RUN/drafter" --steps "$STEPS3" --stop-after "$STOP3" \
    --checkpoint-every 25 --export-every 250 --eval-per-domain 4
# 5. leg 4: warm start from v7 on the second and third datasets together, a fresh cycle at a lower peak
$CLI train-drafter --data "$DATA3,$DATA4" --out "$RUN4" --layers 2 --seqs-per-step 4 --anchors 64 --lr 4e-4 \
    --norm-init ones --init-from "$RUN3/drafter" --draft-vocab "$RUN3/drafter" --steps "$STEPS4" --stop-after "$STOP4" \
    --checkpoint-every 25 --export-every 300 --eval-per-domain 4
# 6. leg 5: warm start from v8 on the seed-3 first turns and their follow-ups together (multi-turn chats)
$CLI train-drafter --data "$DATA5,$DATA5F" --out "$RUN5" --layers 2 --seqs-per-step 4 --anchors 64 --lr 3e-4 \
    --norm-init ones --init-from "$RUN4/drafter" --draft-vocab "$RUN4/drafter" --steps "$STEPS5" --stop-after "$STOP5" \
    --checkpoint-every 25 --export-every 250 --eval-per-domain 4
# 7. leg 6: warm start from v9 on four datasets together, the early positions weighed more
$CLI train-drafter --data "$DATA5,$DATA5F,$DATA,$DATA3" --out "$RUN6" --layers 2 --seqs-per-step 4 --anchors 64 \
    --lr 2e-4 --gamma 3 --norm-init ones --init-from "$RUN5/drafter" --draft-vocab "$RUN5/drafter" --steps "$STEPS6" \
    --checkpoint-every 25 --export-every 200 --eval-per-domain 4
# 8. leg 7: warm start from v11 at block size 8 on all five datasets
$CLI train-drafter --data "$DATA5,$DATA5F,$DATA,$DATA3,$DATA4" --out "$RUN7" --layers 2 --block-size 8 \
    --seqs-per-step 4 --anchors 128 --lr 2e-4 --gamma 3 --norm-init ones --init-from "$RUN6/drafter" \
    --draft-vocab "$RUN6/drafter" --steps "$STEPS7" --checkpoint-every 25 --export-every 250 --eval-per-domain 4
# 9. leg 9: warm start from v12 on the seed-5 greedy and seed-4 sampled datasets together
$CLI train-drafter --data "$DATA9,$DATA9T" --out "$RUN9" --layers 2 --block-size 8 --seqs-per-step 4 --anchors 128 \
    --lr 1.5e-4 --gamma 3 --norm-init ones --init-from "$RUN7/drafter" --draft-vocab "$RUN7/drafter" --steps "$STEPS9" \
    --checkpoint-every 25 --export-every 250 --eval-per-domain 4
# 10. leg 10: a third layer grown from v14, on the same two datasets, a fresh cosine cycle at a higher peak
$CLI train-drafter --data "$DATA9,$DATA9T" --out "$RUN10" --layers 3 --block-size 8 --seqs-per-step 4 --anchors 128 \
    --lr 3e-4 --gamma 3 --norm-init ones --init-from "$RUN9/drafter" --draft-vocab "$RUN9/drafter" --steps "$STEPS10" \
    --checkpoint-every 25 --export-every 400 --eval-per-domain 4
# 11. leg 12: v15 continued with the KL to the target's distributions as half the loss
$CLI train-drafter --data "$DATA9,$DATA9T" --out "$RUN12" --layers 3 --block-size 8 --seqs-per-step 4 --anchors 128 \
    --lr 1.5e-4 --gamma 3 --kl-weight 0.5 --norm-init ones --init-from "$RUN10/drafter" --draft-vocab "$RUN10/drafter" \
    --steps "$STEPS12" --checkpoint-every 25 --export-every 500 --eval-per-domain 4
# 12. leg 14: v17 continued with the same recipe on the two new datasets alone
$CLI train-drafter --data "$DATA14,$DATA14T" --out "$RUN14" --layers 3 --block-size 8 --seqs-per-step 4 --anchors 128 \
    --lr 1.5e-4 --gamma 3 --kl-weight 0.5 --norm-init ones --init-from "$RUN12/drafter" --draft-vocab "$RUN12/drafter" \
    --steps "$STEPS14" --checkpoint-every 25 --export-every 500 --eval-per-domain 4
# 13. leg 16: v19 continued with the same recipe on the chat instructions and the seed-8/9 datasets
$CLI train-drafter --data "$DATA16I,$DATA16IT,$DATA16,$DATA16T" --out "$RUN16" --layers 3 --block-size 8 \
    --seqs-per-step 4 --anchors 128 --lr 1.5e-4 --gamma 3 --kl-weight 0.5 --norm-init ones --init-from "$RUN14/drafter" \
    --draft-vocab "$RUN14/drafter" --steps "$STEPS16" --checkpoint-every 25 --export-every 450 --eval-per-domain 4
# 14. leg 17: v21 continued at a lower peak on the new instructions, their second turns and the seed-8 data
$CLI train-drafter --data "$DATA17I,$DATA17F,$DATA16" --out "$RUN17" --layers 3 --block-size 8 --seqs-per-step 4 \
    --anchors 128 --lr 1e-4 --gamma 3 --kl-weight 0.5 --norm-init ones --init-from "$RUN16/drafter" \
    --draft-vocab "$RUN16/drafter" --steps "$STEPS17" --checkpoint-every 25 --export-every 600 --eval-per-domain 4
# 15. leg 18: v22 continued for longer on every dataset of legs 16 and 17 (each seen less than once before)
$CLI train-drafter --data "$DATA16I,$DATA16IT,$DATA17I,$DATA17F,$DATA16,$DATA16T" --out "$RUN18" --layers 3 \
    --block-size 8 --seqs-per-step 4 --anchors 128 --lr 1.5e-4 --gamma 3 --kl-weight 0.5 --norm-init ones \
    --init-from "$RUN17/drafter" --draft-vocab "$RUN17/drafter" --steps "$STEPS18" --checkpoint-every 25 \
    --export-every 800 --eval-per-domain 4
# 16. leg 19: v23 at leg 17's peak on the seed-13 instructions, their second turns, leg 17's and the seed-8 data
$CLI train-drafter --data "$DATA19I,$DATA19F,$DATA17F,$DATA16" --out "$RUN19" --layers 3 --block-size 8 \
    --seqs-per-step 4 --anchors 128 --lr 1e-4 --gamma 3 --kl-weight 0.5 --norm-init ones --init-from "$RUN18/drafter" \
    --draft-vocab "$RUN18/drafter" --steps "$STEPS19" --checkpoint-every 25 --export-every 900 --eval-per-domain 4
# 17. leg 20: v24 continued on all eight datasets at once, the seed-8 data twice (code and math keep their share)
$CLI train-drafter --data "$DATA16I,$DATA16IT,$DATA17I,$DATA17F,$DATA19I,$DATA19F,$DATA16,$DATA16,$DATA16T" \
    --out "$RUN20" --layers 3 --block-size 8 --seqs-per-step 4 --anchors 128 --lr 1.2e-4 --gamma 3 --kl-weight 0.5 \
    --norm-init ones --init-from "$RUN19/drafter" --draft-vocab "$RUN19/drafter" --steps "$STEPS20" \
    --checkpoint-every 25 --export-every 750 --eval-per-domain 4
# 18. leg 25: v25 grown by a fourth layer, trained on the three new datasets (the seed-15 data twice)
$CLI train-drafter --data "$DATA25S,$DATA25I,$DATA25,$DATA25" --out "$RUN25" --layers 4 --block-size 8 \
    --seqs-per-step 4 --anchors 128 --lr 1.5e-4 --gamma 3 --kl-weight 0.5 --norm-init ones \
    --init-from "$RUN20/drafter" --draft-vocab "$RUN20/drafter" --steps "$STEPS25" --checkpoint-every 25 \
    --export-every 1000 --eval-per-domain 4
# 19. leg 26: v30 continued on the prose requests (twice) with leg 25's chat and instructions
$CLI train-drafter --data "$DATA26W,$DATA26W,$DATA25S,$DATA25I" --out "$RUN26" --layers 4 --block-size 8 \
    --seqs-per-step 4 --anchors 128 --lr 1e-4 --gamma 3 --kl-weight 0.5 --norm-init ones \
    --init-from "$RUN25/drafter" --draft-vocab "$RUN25/drafter" --steps 2000 --checkpoint-every 25 \
    --export-every 500 --eval-per-domain 4
# 20. leg 27: v31 continued on the prose beside every kind of leg 25's data
$CLI train-drafter --data "$DATA26W,$DATA26W,$DATA25S,$DATA25I,$DATA25,$DATA25" --out "$RUN27" --layers 4 \
    --block-size 8 --seqs-per-step 4 --anchors 128 --lr 1e-4 --gamma 3 --kl-weight 0.5 --norm-init ones \
    --init-from "$RUN26/drafter" --draft-vocab "$RUN26/drafter" --steps 2000 --checkpoint-every 25 \
    --export-every 500 --eval-per-domain 4
# 21. ship: bf16 weights in the public DFlash layout with the draft vocabulary, installed with the package
mkdir -p castspec/assets/drafter-smollm2-135m
cp "$RUN27/drafter/config.json" "$RUN27/drafter/model.safetensors" "$RUN27/drafter/draft_vocab.safetensors" \
    castspec/assets/drafter-smollm2-135m/
