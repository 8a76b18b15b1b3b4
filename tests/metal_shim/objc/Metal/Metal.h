// Declarations of the Metal subset metal_src/metal_ffi.mm uses, transcribed from Apple's
// documentation (see Foundation/Foundation.h here). Not an implementation.
#pragma once
#import <Foundation/Foundation.h>
typedef NSInteger MTLGPUFamily;
typedef NSUInteger MTLResourceOptions;
static const MTLResourceOptions MTLResourceStorageModeShared = 0;
typedef enum : NSUInteger {
  MTLCommandBufferStatusNotEnqueued = 0,
  MTLCommandBufferStatusEnqueued = 1,
  MTLCommandBufferStatusCommitted = 2,
  MTLCommandBufferStatusScheduled = 3,
  MTLCommandBufferStatusCompleted = 4,
  MTLCommandBufferStatusError = 5,
} MTLCommandBufferStatus;
typedef struct {
  NSUInteger width, height, depth;
} MTLSize;
MTLSize MTLSizeMake(NSUInteger width, NSUInteger height, NSUInteger depth);

@protocol MTLBuffer <NSObject>
@property(readonly) void* contents;
@property(readonly) NSUInteger length;
@end
@protocol MTLFunction <NSObject>
@end
@protocol MTLLibrary <NSObject>
- (id<MTLFunction>)newFunctionWithName:(NSString*)functionName;
@end
@protocol MTLComputePipelineState <NSObject>
@property(readonly) NSUInteger maxTotalThreadsPerThreadgroup;
@end
@protocol MTLComputeCommandEncoder <NSObject>
- (void)setComputePipelineState:(id<MTLComputePipelineState>)state;
- (void)setBuffer:(id<MTLBuffer>)buffer offset:(NSUInteger)offset atIndex:(NSUInteger)index;
- (void)setBytes:(const void*)bytes length:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)dispatchThreadgroups:(MTLSize)threadgroupsPerGrid threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup;
- (void)endEncoding;
@end
@protocol MTLCommandBuffer <NSObject>
- (id<MTLComputeCommandEncoder>)computeCommandEncoder;
- (void)commit;
- (void)waitUntilCompleted;
@property(readonly) MTLCommandBufferStatus status;
@property(readonly) NSError* error;
@end
@protocol MTLCommandQueue <NSObject>
- (id<MTLCommandBuffer>)commandBuffer;
@end
@protocol MTLDevice <NSObject>
@property(readonly) NSString* name;
- (id<MTLCommandQueue>)newCommandQueue;
- (id<MTLLibrary>)newLibraryWithURL:(NSURL*)url error:(NSError**)error;
- (id<MTLComputePipelineState>)newComputePipelineStateWithFunction:(id<MTLFunction>)computeFunction
                                                             error:(NSError**)error;
- (id<MTLBuffer>)newBufferWithLength:(NSUInteger)length options:(MTLResourceOptions)options;
- (id<MTLBuffer>)newBufferWithBytesNoCopy:(void*)pointer
                                   length:(NSUInteger)length
                                  options:(MTLResourceOptions)options
                              deallocator:(void (^)(void* pointer, NSUInteger length))deallocator;
- (BOOL)supportsFamily:(MTLGPUFamily)gpuFamily;
@end
id<MTLDevice> MTLCreateSystemDefaultDevice(void);
