#!/usr/bin/env bash
# build every config of configs.txt into lib/<name>.so (NVCC, CUTLASS_INC, CUDA_INC from the environment)
cd "$(dirname "$0")"; mkdir -p lib
while read -r name tm tn tk cm cn sched tsched; do
  [ -f lib/$name.so ] && continue
  echo "$NVCC -O3 -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -DNDEBUG -DTM=$tm -DTN=$tn -DTK=$tk -DCM=$cm -DCN=$cn -DSCHED=$sched -DTSCHED=$tsched -I$CUTLASS_INC -I$CUTLASS_UTIL -I$CUDA_INC -L$CUDA_LIB -Xcompiler -fPIC -shared -o lib/$name.so gemm.cu > lib/$name.log 2>&1 || echo FAIL $name"
done < configs.txt | xargs -P ${JOBS:-2} -I{} sh -c "{}"
ls lib/*.so | wc -l
