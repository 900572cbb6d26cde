import cupy as cp,numpy as np
from convolab.gpu import fused_wide as f
from convolab.models import conv_blocks
for m,p in (('ece408-mxnet','fp16'),('eecs498','fp16'),('ece408-mxnet','3xfp16')):
 k=conv_blocks(m,10000)[1];s=k.shape
 r=f.prepare(s,np.random.rand(*s.w_shape).astype('f'),np.zeros(s.M,'f'),{},p,'float32',pool=k.pool)
 x=cp.random.rand(*s.x_shape,dtype='f');y=cp.empty((s.B,s.M,s.H_out//2,s.W_out//2),'f');r(x,y);cp.cuda.Device().synchronize()
