package ledger

import "github.com/twmb/franz-go/pkg/kgo"

// LoopDecompressors are franz-go's decompressor bounded at max, and the
// one a Loop's client decodes fetched batches with (wideZstdDecoded),
// with its release.
func LoopDecompressors(max int) (bounded, loop kgo.Decompressor, release func(), err error) {
	d, err := newWideZstdDecoded(max)
	if err != nil {
		return nil, nil, nil, err
	}
	return d.bounded, d, d.Close, nil
}
