package ledgertest

import "github.com/twmb/franz-go/pkg/kmsg"

// StaleStartOffsets, a kfake ControlKey function for ListOffsets, answers
// the first listing of the log's start offsets with 0 for every
// partition, as before records were deleted, and leaves every other
// request to the broker.
func StaleStartOffsets(kreq kmsg.Request) (kmsg.Response, error, bool) {
	return AnswerListOffsets(kreq, func(rp kmsg.ListOffsetsRequestTopicPartition, sp *kmsg.ListOffsetsResponseTopicPartition) bool {
		if rp.Timestamp != -2 { // not the log's start
			return false
		}
		sp.Offset, sp.Timestamp, sp.LeaderEpoch = 0, -1, -1
		return true
	})
}

// AnswerListOffsets answers a ListOffsets request (kreq) as answer fills
// each partition's answer in; one partition it declines to answer leaves
// the whole request to the broker.
func AnswerListOffsets(kreq kmsg.Request, answer func(kmsg.ListOffsetsRequestTopicPartition, *kmsg.ListOffsetsResponseTopicPartition) bool) (kmsg.Response, error, bool) {
	req := kreq.(*kmsg.ListOffsetsRequest)
	resp := req.ResponseKind().(*kmsg.ListOffsetsResponse)
	resp.Version = req.Version
	for _, rt := range req.Topics {
		st := kmsg.NewListOffsetsResponseTopic()
		st.Topic = rt.Topic
		for _, rp := range rt.Partitions {
			sp := kmsg.NewListOffsetsResponseTopicPartition()
			sp.Partition = rp.Partition
			if !answer(rp, &sp) {
				return nil, nil, false
			}
			st.Partitions = append(st.Partitions, sp)
		}
		resp.Topics = append(resp.Topics, st)
	}
	return resp, nil, true
}
