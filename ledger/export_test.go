package ledger

import "github.com/twmb/franz-go/pkg/kgo"

// LoopDecompressors are franz-go's decompressor bounded at max, and the
// one a Loop's client decodes fetched batches with
// (undecodableAsTooLarge over it).
func LoopDecompressors(max int) (bounded, loop kgo.Decompressor, err error) {
	dec, err := boundedDecompressor(max)
	if err != nil {
		return nil, nil, err
	}
	return dec, undecodableAsTooLarge{bounded: dec}, nil
}
