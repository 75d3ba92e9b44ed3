import torch, time, sys
sys.path.insert(0, ".")
from relax_gdn.bench.timing import cuda_median_ms
from relax_gdn.model.fp8.casts import CastKernels, _amax_and_scaled_bits
from tests.test_fp8_gpu import _impl
dev="cuda"; bf=torch.bfloat16
x=torch.randn(8192,4096,device=dev,dtype=bf); w=torch.randn(4096,4096,device=dev,dtype=bf)
k=CastKernels(); ke=CastKernels(compile_on_cuda=False)
f8=torch.float8_e4m3fn
k.amax_and_scaled_bits(x,None,f8,False)
print("cast compiled ms", cuda_median_ms(lambda: k.amax_and_scaled_bits(x,None,f8,False), align_ranks=False))
print("cast eager ms", cuda_median_ms(lambda: ke.amax_and_scaled_bits(x,None,f8,False), align_ranks=False))
c=torch.compile(_amax_and_scaled_bits, dynamic=True); c(x,None,f8,False)
print("cast compiled no patch ms", cuda_median_ms(lambda: c(x,None,f8,False), align_ranks=False))
c2=torch.compile(_amax_and_scaled_bits); c2(x,None,f8,False)
print("cast compiled static ms", cuda_median_ms(lambda: c2(x,None,f8,False), align_ranks=False))
torch.cuda.synchronize(); t=time.perf_counter()
for _ in range(100): k.amax_and_scaled_bits(x,None,f8,False)
print("host us per compiled call (patch)", (time.perf_counter()-t)*1e4)
torch.cuda.synchronize(); t=time.perf_counter()
for _ in range(100): c(x,None,f8,False)
print("host us per compiled call (no patch)", (time.perf_counter()-t)*1e4)
a=x.to(f8); b=w.to(f8).t(); one=torch.ones((),device=dev)
print("scaled_mm ms", cuda_median_ms(lambda: torch._scaled_mm(a,b,one,one,out_dtype=bf,use_fast_accum=True), align_ranks=False))
print("bf16 mm ms", cuda_median_ms(lambda: x@w.t(), align_ranks=False))
impl=_impl("tensorwise"); xr=x.clone().requires_grad_(); wr=w.clone().requires_grad_(); g=torch.randn(8192,4096,device=dev,dtype=bf)
def fb(): impl(xr,wr).backward(g)
fb(); fb()
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
    for _ in range(3): fb()
    torch.cuda.synchronize()
print(p.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
