// Declarations of the Foundation subset metal_src/metal_ffi.mm uses, transcribed from
// Apple's documentation, so that clang can type-check the bridge off macOS
// (tests/test_metal.py::test_bridge_type_checks). Not an implementation.
#pragma once
typedef unsigned long NSUInteger;
typedef long NSInteger;
typedef signed char BOOL;
#define nil nullptr
__attribute__((objc_root_class))
@interface NSObject
+ (instancetype)alloc;
@end
@protocol NSObject
@end
@interface NSString : NSObject
+ (instancetype)stringWithUTF8String:(const char*)s;
@property(readonly) const char* UTF8String;
@end
@interface NSURL : NSObject
+ (instancetype)fileURLWithPath:(NSString*)path;
@end
@interface NSError : NSObject
@property(readonly, copy) NSString* localizedDescription;
@end
