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

// TestUndecodableBatchesAreTooLarge: a batch the loop's bounded
// decompressor cannot decode (a zstd window past the bound) is reported
// as past the bound (kgo.ErrMaxDecompress), which franz-go turns into a
// skip with the batch's offsets; franz-go's own error for it is another,
// which it keeps at the batch, fetching it again for good. A batch past
// the bound is still refused, and one within it decoded.
func TestUndecodableBatchesAreTooLarge(t *testing.T) {
	const bound = 1 << 20
	bounded, dec, err := ledger.LoopDecompressors(bound)
	if err != nil {
		t.Fatal(err)
	}
	wide := ledgertest.WideZstd(t, []byte(`{"tool":"get_weather"}`), 23) // 8 MiB
	if _, err := bounded.Decompress(wide, kgo.CodecZstd); err == nil || errors.Is(err, kgo.ErrMaxDecompress) {
		t.Fatalf("franz-go's bounded decoder on a wide window: %v; want an error other than the bound's (the case this guards)", err)
	}
	if _, err := dec.Decompress(wide, kgo.CodecZstd); !errors.Is(err, kgo.ErrMaxDecompress) {
		t.Errorf("a zstd window past the bound: %v; want kgo.ErrMaxDecompress", err)
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
	narrow := ledgertest.WideZstd(t, []byte(`{"tool":"get_weather"}`), 16) // 64 KiB
	if out, err := dec.Decompress(narrow, kgo.CodecZstd); err != nil || string(out) != `{"tool":"get_weather"}` {
		t.Errorf("a batch within the bound: %q, %v; want it decoded", out, err)
	}
}
