package ledgertest

import (
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
