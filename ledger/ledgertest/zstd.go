package ledgertest

import (
	"bytes"
	"testing"

	"github.com/klauspost/compress/zstd"
)

// WideZstd is a zstd frame of data that declares a window of 1<<log
// bytes, as a producer at a high compression level writes them (an
// encoder shrinks the window to a small input's size): the encoder's
// frame, its window descriptor (the byte after the magic and the frame
// header descriptor, without a single segment) rewritten to exponent
// log-10, no mantissa. The frame's checksum is of its content alone.
func WideZstd(t testing.TB, data []byte, log int) []byte {
	t.Helper()
	enc, err := zstd.NewWriter(nil, zstd.WithSingleSegment(false))
	if err != nil {
		t.Fatal(err)
	}
	defer enc.Close()
	b := enc.EncodeAll(data, nil)
	b[5] = byte(log-10) << 3
	var h zstd.Header
	if err := h.Decode(b); err != nil || h.SingleSegment || h.WindowSize != 1<<log {
		t.Fatalf("the frame's header %+v (%v); want a window of %d bytes", h, err, 1<<log)
	}
	return b
}

// WideZstdStream is a zstd frame of data as a streaming writer (a
// broker's, a Java producer's) writes it: its window of window bytes
// declared, its content size not.
func WideZstdStream(t testing.TB, data []byte, window int) []byte {
	t.Helper()
	var b bytes.Buffer
	enc, err := zstd.NewWriter(&b, zstd.WithWindowSize(window))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := enc.Write(data); err != nil {
		t.Fatal(err)
	}
	if err := enc.Close(); err != nil {
		t.Fatal(err)
	}
	var h zstd.Header
	if err := h.Decode(b.Bytes()); err != nil || h.HasFCS || h.WindowSize != uint64(window) {
		t.Fatalf("the frame's header %+v (%v); want a window of %d bytes and no content size", h, err, window)
	}
	return b.Bytes()
}
