package ledger_test

import (
	"bytes"
	"compress/gzip"
	"errors"
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/ledgertest"
)

// TestWideZstdBatchesAreDecoded: a zstd batch whose frame declares a
// window past the loop's bound is decoded within it; franz-go's bounded
// decoder refuses it with an error it keeps at the batch, fetching it
// again for good. One whose content is past the bound is refused as the
// bound's (kgo.ErrMaxDecompress: skipped, its offsets known), as a gzip
// batch past it is; one within a narrow window is decoded as before.
func TestWideZstdBatchesAreDecoded(t *testing.T) {
	const bound = 1 << 20
	bounded, dec, release, err := ledger.LoopDecompressors(bound)
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	small := []byte(`{"tool":"get_weather"}`)
	wide := ledgertest.WideZstd(t, small, 23) // 8 MiB
	if _, err := bounded.Decompress(wide, kgo.CodecZstd); err == nil || errors.Is(err, kgo.ErrMaxDecompress) {
		t.Fatalf("franz-go's bounded decoder on a wide window: %v; want an error other than the bound's (the case this guards)", err)
	}
	if out, err := dec.Decompress(wide, kgo.CodecZstd); err != nil || !bytes.Equal(out, small) {
		t.Errorf("a zstd window past the bound, its content within: %q, %v; want it decoded", out, err)
	}
	big := bytes.Repeat([]byte("v"), 3*bound/2)
	if _, err := dec.Decompress(ledgertest.WideZstd(t, big, 23), kgo.CodecZstd); !errors.Is(err, kgo.ErrMaxDecompress) {
		t.Errorf("a zstd window past the bound, its content too: %v; want kgo.ErrMaxDecompress", err)
	}
	// As a streaming writer writes them: no content size stated, the
	// decoder finding the output past its buffer as it goes.
	within := bytes.Repeat([]byte(`{"tool":"get_weather","arguments":{"city":"Oslo"}}`), bound/2/50)
	if out, err := dec.Decompress(ledgertest.WideZstdStream(t, within, 32<<20), kgo.CodecZstd); err != nil || !bytes.Equal(out, within) {
		t.Errorf("a streamed zstd frame of a wide window, its %d bytes within the bound: %d bytes, %v; want it decoded", len(within), len(out), err)
	}
	past := bytes.Repeat([]byte(`{"tool":"get_weather","arguments":{"city":"Oslo"}}`), 3*bound/2/50)
	if _, err := dec.Decompress(ledgertest.WideZstdStream(t, past, 32<<20), kgo.CodecZstd); !errors.Is(err, kgo.ErrMaxDecompress) {
		t.Errorf("a streamed zstd frame of a wide window, its %d bytes past the bound: %v; want kgo.ErrMaxDecompress", len(past), err)
	}
	var bomb bytes.Buffer
	zw := gzip.NewWriter(&bomb)
	if _, err := zw.Write(make([]byte, 2*bound)); err != nil {
		t.Fatal(err)
	}
	zw.Close()
	if _, err := dec.Decompress(bomb.Bytes(), kgo.CodecGzip); !errors.Is(err, kgo.ErrMaxDecompress) {
		t.Errorf("a gzip batch of twice the bound: %v; want kgo.ErrMaxDecompress", err)
	}
	narrow := ledgertest.WideZstd(t, small, 16) // 64 KiB
	if out, err := dec.Decompress(narrow, kgo.CodecZstd); err != nil || !bytes.Equal(out, small) {
		t.Errorf("a batch within the bound: %q, %v; want it decoded", out, err)
	}
}
